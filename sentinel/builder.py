"""The one wiring place: builds every part of the daemon from config, then the Daemon in one call.

Order: the NVML source (a missing NVML stops here, before anything is created on disk); the
runtime and state directories, checked; the control channel to the ranks; the action backend,
checked against its scheduler; the migration sequence; the kernel-event sources (the rank-signal
source watches the ranks the channel verified); the executor; then ``Daemon(...)`` with all of
them. Nothing is set on the daemon or its parts afterwards. Anything that fails after the channel
is open closes it again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from sentinel.actions import Executor
from sentinel.backends import make_backend
from sentinel.backends.base import Backend, BackendContext, BackendError, Unreachable
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import Config
from sentinel.daemon import Daemon, EventSource, StartupError, check_directories
from sentinel.log import event
from sentinel.migration import Migrator
from sentinel.sources.nvml import NvmlSource, NvmlUnavailable
from sentinel.systemd import Notifier


def build_daemon(cfg: Config, *, simulate: str | None = None, no_ebpf: bool = False,
                 event_sources: Iterable[EventSource] | None = None, nvml_backend: Any = None) -> Daemon:
    """The daemon ``sentinel run`` runs. ``event_sources`` replaces the kernel-event sources the
    config names (a test's fixture sources), ``nvml_backend`` the pynvml module (a bench's
    instrumented look-alike); everything else comes from ``cfg``. Raises NvmlUnavailable or
    StartupError (one sentence each)."""
    nvml = nvml_source(cfg, simulate, nvml_backend)
    runtime = Path(cfg.daemon.runtime_dir)
    state = Path(cfg.daemon.state_dir)
    check_directories(runtime, state)
    node = cfg.daemon.node_name or socket.gethostname()
    wake, urgent = threading.Event(), threading.Event()

    def act_now() -> None:  # a finished backend call: the migration's next step at once (Daemon.act_now)
        urgent.set()
        wake.set()
    endpoint = open_endpoint(cfg, runtime)
    try:
        backend, up = start_backend(cfg, node, state, runtime)
        migrator = Migrator(cfg.actions, endpoint, state_dir=state, runtime_dir=runtime, node=node, backend=backend,
                            wake=act_now, backend_up=up)
        # rank signals watch the verified ranks only
        sources = (list(event_sources) if event_sources is not None
                   else kernel_sources(cfg, no_ebpf=no_ebpf, ranks=lambda: endpoint.ranks().keys()))
    except BaseException:
        endpoint.close()
        raise
    return Daemon(cfg, nvml, event_sources=sources, executor=Executor(trainer=endpoint, migrator=migrator),
                  endpoint=endpoint, migrator=migrator, notifier=Notifier(), wake=wake, urgent=urgent)


def nvml_source(cfg: Config, simulate: str | None = None, backend: Any = None) -> NvmlSource:
    """``backend`` when given; else the simulated backend's state file when ``simulate`` names one,
    else pynvml."""
    if backend is not None:
        return NvmlSource(backend, deadline_seconds=cfg.daemon.nvml_deadline_seconds, source_name="nvml")
    if simulate:
        from sentinel.sources.simulated import SimulatedNvml

        return NvmlSource(SimulatedNvml(simulate), deadline_seconds=cfg.daemon.nvml_deadline_seconds, source_name="nvml")
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared; a broken install still gets one sentence
        raise NvmlUnavailable(f"the nvidia-ml-py package cannot be imported: {exc}") from None
    return NvmlSource(pynvml, deadline_seconds=cfg.daemon.nvml_deadline_seconds)


def kernel_sources(cfg: Config, *, no_ebpf: bool = False, ranks: Callable[[], Iterable[int]] | None = None) -> list[Any]:
    """Xid (eBPF or /dev/kmsg), rank signals (of the pids ``ranks`` offers), host memory errors,
    PCIe AER. None of them can stop the daemon from starting: each reports itself down instead."""
    from sentinel.sources.mem_errors import MemErrorSource
    from sentinel.sources.pcie_aer import PcieAerSource
    from sentinel.sources.rank_signals import RankSignalSource
    from sentinel.sources.xid import XidSource

    use_ebpf = cfg.ebpf.enabled and not no_ebpf
    sources: list[Any] = []
    if use_ebpf or cfg.ebpf.kmsg_fallback:
        sources.append(XidSource(use_ebpf=use_ebpf, kmsg_fallback=cfg.ebpf.kmsg_fallback))
    if use_ebpf and cfg.ebpf.rank_signals:
        sources.append(RankSignalSource(Path(cfg.daemon.runtime_dir) / "ranks", ranks_provider=ranks))
    if use_ebpf:
        sources.append(MemErrorSource())
    sources.append(PcieAerSource(use_ebpf=use_ebpf))
    return sources


def open_endpoint(cfg: Config, runtime: Path) -> DaemonEndpoint:
    """The control channel to this node's ranks, in the (checked) runtime directory."""
    pidfile = Path(cfg.actions.agent_pidfile) if cfg.actions.agent_pidfile else runtime / "agent.pid"
    try:
        return DaemonEndpoint(runtime, agent_pidfile=pidfile, registration=cfg.actions.agent_registration)
    except OSError as exc:
        raise StartupError(f"cannot open the control channel in {runtime}: {exc.strerror}") from None


def start_backend(cfg: Config, node: str, state: Path, runtime: Path) -> tuple[Backend, bool | None]:
    """The configured action backend, checked once against its scheduler (:func:`check_backend`)."""
    try:
        backend = make_backend(cfg.actions, BackendContext(node=node, state_dir=state, runtime_dir=runtime,
                                                           timeout=cfg.actions.command_timeout_seconds, wall=time.time))
    except BackendError as exc:
        raise StartupError(f"actions.backend = {cfg.actions.backend!r}: {exc}") from None
    return backend, check_backend(backend)


def check_backend(backend: Backend) -> bool | None:
    """At start, once: the scheduler must know this node and let the daemon act on it
    (StartupError naming the node, the missing RBAC verb / Slurm privilege, or the missing
    client). A scheduler that does not answer is no reason to stay blind: the daemon starts, logs
    it and exports ``sentinel_backend_up 0``; every later call is retried. Returns whether the
    scheduler answered (None: the backend has none)."""
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
