"""Builds a Daemon from config: picks the NVML backend, the kernel-event sources and the actions."""

from __future__ import annotations

from sentinel.config import Config
from sentinel.daemon import Daemon
from sentinel.sources.nvml import NvmlSource, NvmlUnavailable
from sentinel.systemd import Notifier


def build_daemon(cfg: Config, *, simulate: str | None = None, no_ebpf: bool = False) -> Daemon:
    if simulate:
        from sentinel.sources.simulated import SimulatedNvml

        source = NvmlSource(SimulatedNvml(simulate), deadline_seconds=cfg.daemon.nvml_deadline_seconds, source_name="nvml")
    else:
        try:
            import pynvml
        except ImportError as exc:  # the dependency is declared; a broken install still gets one sentence
            raise NvmlUnavailable(f"the nvidia-ml-py package cannot be imported: {exc}") from None
        source = NvmlSource(pynvml, deadline_seconds=cfg.daemon.nvml_deadline_seconds)
    daemon = Daemon(cfg, source, notifier=Notifier(), event_sources=kernel_sources(cfg, no_ebpf=no_ebpf))
    attach_actions(daemon)
    return daemon


def kernel_sources(cfg: Config, *, no_ebpf: bool = False) -> list:
    """Xid (eBPF or /dev/kmsg), rank signals, host memory errors, PCIe AER. None of them can
    stop the daemon from starting: each reports itself down instead."""
    from pathlib import Path

    from sentinel.sources.mem_errors import MemErrorSource
    from sentinel.sources.pcie_aer import PcieAerSource
    from sentinel.sources.rank_signals import RankSignalSource
    from sentinel.sources.xid import XidSource

    use_ebpf = cfg.ebpf.enabled and not no_ebpf
    sources: list = []
    if use_ebpf or cfg.ebpf.kmsg_fallback:
        sources.append(XidSource(use_ebpf=use_ebpf, kmsg_fallback=cfg.ebpf.kmsg_fallback))
    if use_ebpf and cfg.ebpf.rank_signals:
        sources.append(RankSignalSource(Path(cfg.daemon.runtime_dir) / "ranks"))
    if use_ebpf:
        sources.append(MemErrorSource())
    sources.append(PcieAerSource(use_ebpf=use_ebpf))
    return sources


def attach_actions(daemon: Daemon) -> None:
    """The control channel to this node's ranks and the migration sequence. The directories are
    checked (owner, mode, writable) before anything is bound in them."""
    import socket
    from pathlib import Path

    import time

    from sentinel.actions import Executor
    from sentinel.backends import make_backend
    from sentinel.backends.base import BackendContext, BackendError
    from sentinel.channel import DaemonEndpoint
    from sentinel.daemon import StartupError, check_directories
    from sentinel.migration import Migrator

    cfg = daemon.config
    runtime = Path(cfg.daemon.runtime_dir)
    state = Path(cfg.daemon.state_dir)
    check_directories(runtime, state)
    pidfile = Path(cfg.actions.agent_pidfile) if cfg.actions.agent_pidfile else runtime / "agent.pid"
    try:
        endpoint = DaemonEndpoint(runtime, agent_pidfile=pidfile, registration=cfg.actions.agent_registration)
    except OSError as exc:
        raise StartupError(f"cannot open the control channel in {runtime}: {exc.strerror}") from None
    node = cfg.daemon.node_name or socket.gethostname()
    try:
        backend = make_backend(cfg.actions, BackendContext(node=node, state_dir=state, runtime_dir=runtime,
                                                           timeout=cfg.actions.command_timeout_seconds, wall=time.time))
    except BackendError as exc:
        endpoint.close()
        raise StartupError(f"actions.backend = {cfg.actions.backend!r}: {exc}") from None
    try:
        up = check_backend(backend)
    except StartupError:
        endpoint.close()
        raise
    migrator = Migrator(cfg.actions, endpoint, state_dir=state, runtime_dir=runtime, node=node, backend=backend,
                        wake=daemon._wake.set)
    migrator.backend_up = up
    daemon.endpoint = endpoint
    daemon.migrator = migrator
    daemon.executor = Executor(trainer=endpoint, migrator=migrator)
    daemon.extra_counters += [endpoint.metric_counters, migrator.metric_counters]
    daemon.extra_gauges.append(migrator.gauges)
    for src in daemon.event_sources:  # rank signals watch the verified ranks only
        if getattr(src, "name", "") == "rank_signals":
            src.ranks_provider = lambda: endpoint.ranks().keys()


def check_backend(backend) -> bool | None:
    """At start, once: the scheduler must know this node and let the daemon act on it
    (StartupError naming the node, the missing RBAC verb / Slurm privilege, or the missing
    client). A scheduler that does not answer is no reason to stay blind: the daemon starts, logs
    it and exports ``sentinel_backend_up 0``; every later call is retried. Returns whether the
    scheduler answered (None: the backend has none)."""
    import logging

    from sentinel.backends.base import BackendError, Unreachable
    from sentinel.daemon import StartupError
    from sentinel.log import event

    if not backend.has_scheduler:
        return None
    try:
        backend.check()
    except Unreachable as exc:
        event(logging.getLogger("sentinel.daemon"), "scheduler unreachable at start; starting anyway", logging.ERROR,
              backend=backend.name, error=str(exc))
        return False
    except BackendError as exc:
        raise StartupError(f"refusing to start: {backend.name} backend: {exc}") from None
    return True
