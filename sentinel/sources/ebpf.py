"""Shared loader for Sentinel's BPF programs (``ebpf/*.bpf.c``, shipped as package data) through bcc.

Each probe: check that its tracepoint exists, compile with settings as ``-D`` cflags, read a
ring buffer on a thread of its own, and count what the kernel could not deliver (the program's
``lost`` array). A probe never decides anything.

bcc's Python module is Debian's (``python3-bpfcc``, in ``/usr/lib/python3/dist-packages``): pure
Python over libbcc, so it loads into any Python 3; only that one package is taken from there.
"""

from __future__ import annotations

import importlib
import importlib.resources
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("sentinel.ebpf")

TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
DIST_PACKAGES = "/usr/lib/python3/dist-packages"


class EbpfUnavailable(RuntimeError):
    """The eBPF path cannot run here (no bcc, no privileges, no tracepoint, old kernel)."""


def ebpf_dir() -> Path:
    """Where the ``*.bpf.c`` programs and ``events.h`` are: package data of ``sentinel``
    (``sentinel/ebpf``, a symlink to the top-level ``ebpf/`` in a checkout, real files in a
    wheel), found through ``importlib.resources``; ``SENTINEL_EBPF_DIR`` overrides it.

    bcc compiles from a directory (``-I`` for ``events.h``), so the resources must be files on
    disk: an install that left them inside a zip raises :class:`EbpfUnavailable`."""
    env = os.environ.get("SENTINEL_EBPF_DIR")
    if env:
        return Path(env)
    resource = importlib.resources.files("sentinel") / "ebpf"
    if not isinstance(resource, Path):
        raise EbpfUnavailable(f"the BPF programs are not files on disk ({resource}); install sentinel unpacked")
    return resource


def import_bcc() -> Any:
    try:
        return importlib.import_module("bcc")
    except ImportError:
        pass
    if not os.path.isdir(os.path.join(DIST_PACKAGES, "bcc")):
        raise EbpfUnavailable("bcc is not installed (apt-get install python3-bpfcc)")
    sys.path.append(DIST_PACKAGES)
    try:
        return importlib.import_module("bcc")
    except ImportError as exc:
        raise EbpfUnavailable(f"bcc cannot be imported: {exc}") from None
    finally:
        sys.path.remove(DIST_PACKAGES)


def tracepoint_exists(category: str, event: str) -> bool:
    return any((root / "events" / category / event).is_dir() for root in TRACEFS)


class RingProbe:
    """One BPF program with a ring buffer named ``events`` and a ``lost`` counter array."""

    def __init__(self, name: str, program: str, tracepoint: tuple[str, str], *,
                 cflags: dict[str, int | str] | None = None,
                 on_event: Callable[[Any], None], poll_ms: int = 250) -> None:
        self.name = name
        self.program = program
        self.tracepoint = tracepoint
        self.cflags = dict(cflags or {})
        self.on_event = on_event
        self.poll_ms = poll_ms
        self.bpf: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if os.geteuid() != 0:
            raise EbpfUnavailable("loading BPF programs needs root (CAP_BPF and CAP_PERFMON)")
        if not tracepoint_exists(*self.tracepoint):
            raise EbpfUnavailable(f"tracepoint {':'.join(self.tracepoint)} does not exist on this kernel")
        bcc = import_bcc()
        src_dir = ebpf_dir()
        path = src_dir / self.program
        try:
            text = path.read_text()
        except OSError as exc:
            raise EbpfUnavailable(f"{path}: {exc.strerror}") from None
        flags = [f"-I{src_dir}"] + [f"-D{k}={v}" for k, v in self.cflags.items()]
        try:
            self.bpf = bcc.BPF(text=text.encode(), cflags=flags)
            self.bpf[b"events"].open_ring_buffer(self._callback)
        except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception on compile/load failures
            raise EbpfUnavailable(f"{self.program} failed to load: {exc}") from None
        self._thread = threading.Thread(target=self._poll, name=f"sentinel-ebpf-{self.name}", daemon=True)
        self._thread.start()

    def _callback(self, ctx: Any, data: Any, size: int) -> None:
        try:
            self.on_event(self.bpf[b"events"].event(data))
        except Exception:  # noqa: BLE001 - one bad event never stops the probe
            log.exception("%s: event handler failed", self.name)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.bpf.ring_buffer_poll(self.poll_ms)
            except Exception:  # noqa: BLE001 - logged; the loop goes on
                log.exception("%s: ring buffer poll failed", self.name)
                self._stop.wait(1.0)

    def lost(self) -> int:
        if self.bpf is None:
            return 0
        return int(sum(v.value for v in self.bpf[b"lost"].values()))

    def table(self, name: str) -> Any:
        return self.bpf[name.encode()]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None
