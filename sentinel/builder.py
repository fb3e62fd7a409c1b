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
    return Daemon(cfg, source, notifier=Notifier())
