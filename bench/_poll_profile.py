"""The in-process parts of bench/poll_overhead.py: one poll's CPU split by part, and an Xid storm.

Every figure is CPU time: ``time.process_time`` (every thread of this process) for the whole,
``time.thread_time`` inside each part. The parts are timed by wrapping the daemon's own methods on
its instances (nothing in ``sentinel/`` knows it is measured), the backend by a pynvml look-alike
that times every call on whatever thread makes it; that timing's own cost around each call
(calibrated, :func:`timing_cost`) is the ``profiler`` part, in neither the backend nor the daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from sentinel import config
from sentinel.builder import build_daemon
from sentinel.sources import simulated
from sentinel.sources.xid import XidSource

PARTS = ("backend", "nvml_source", "rules", "state", "metrics", "profiler")


class TimedNvml:
    """Times every pynvml call made through it (CPU of the calling thread), on any thread."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self.cpu = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if callable(value) and name.startswith("nvml") and not isinstance(value, type):
            value = self._timed(value)
        self.__dict__[name] = value  # as a module's attribute: looked up once, not wrapped again
        return value

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                dt = time.thread_time() - t
                with self._lock:
                    self.cpu += dt
                    self.calls += 1
        return timed


class _Null:
    def nvmlNull(self) -> None:
        return None


def timing_cost(calls: int = 20000) -> float:
    """CPU seconds one :class:`TimedNvml` call costs its caller outside the window it charges to
    the backend (its own two clock reads, lock and closure; ~1.5 µs): the profile's overhead, in
    no part of the daemon. Calibrated on a call that does nothing, against the same call unwrapped
    (best of 5); in the daemon's busier loop a call's overhead is, if anything, larger."""
    timed, plain = TimedNvml(_Null()), _Null()
    best = float("inf")
    for _ in range(5):
        c0 = time.thread_time()
        for _ in range(calls):
            plain.nvmlNull()
        c1, inside = time.thread_time(), timed.cpu
        fn = timed.nvmlNull
        for _ in range(calls):
            fn()
        c2 = time.thread_time()
        best = min(best, ((c2 - c1) - (timed.cpu - inside) - (c1 - c0)) / calls)
    return max(0.0, best)


class PartClock:
    """CPU of the calling thread spent inside the wrapped methods, per part."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self.cpu.setdefault(part, 0.0)

        def timed(*args: Any, **kw: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                self.cpu[part] += time.thread_time() - t
        return timed


# The daemon's runtime directory is /run/sentinel, a tmpfs: status.json is rewritten there every
# poll. /dev/shm is one too; a disk-backed /tmp would charge the daemon a journalled rename a poll.
RUNTIME_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _daemon(tmp: Path, run: Path, gpus: int, call_cost: float, sources: list, detail: str = "fleet"):
    state = tmp / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(gpus))
    cfg = config.parse(f'[daemon]\nruntime_dir = "{run}"\nstate_dir = "{tmp / "state"}"\n'
                       f'[metrics]\nlisten_address = "127.0.0.1"\nport = 0\ndetail = "{detail}"\n'
                       f'[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    backend = TimedNvml(simulated.SimulatedNvml(state, call_cost_seconds=call_cost))
    return build_daemon(cfg, nvml_backend=backend, event_sources=sources), backend


def _instrument(daemon) -> PartClock:
    clock = PartClock()
    daemon.nvml.poll = clock.wrap("nvml_main", daemon.nvml.poll)
    daemon.policy.decide = clock.wrap("rules", daemon.policy.decide)
    daemon.publish = clock.wrap("publish", daemon.publish)
    daemon.write_status = clock.wrap("status", daemon.write_status)
    daemon.poll_once = clock.wrap("loop", daemon.poll_once)
    return clock


def profile(gpus: int, polls: int, call_cost: float, detail: str = "fleet", scrape_every: int = 15,
            batches: int = 10) -> dict[str, float]:
    """ms of CPU per poll, by part, over ``polls`` back-to-back polls of a started daemon, one
    scrape (a full render of the exposition) every ``scrape_every`` polls: Prometheus at 15 s.
    The polls run in ``batches``; the figures are those of the batch the daemon spent least in
    (on a shared host, other work only ever adds to a batch's CPU time: cache misses, migrations)."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir=RUNTIME_ROOT) as run:
        daemon, backend = _daemon(Path(d), Path(run) / "run", gpus, call_cost,
                                  [XidSource(use_ebpf=False, kmsg_fallback=False)], detail)
        try:
            daemon.start()
            for _ in range(5):  # past start-up: caches, the first render
                daemon.poll_once()
            clock = _instrument(daemon)
            scrape = clock.wrap("render", daemon.httpd.exposition)
            rows = []
            n = max(1, polls // batches)
            per_call = timing_cost()
            for _ in range(batches):
                before = dict(clock.cpu)
                b0, c0, k0 = backend.cpu, time.process_time(), backend.calls
                for i in range(n):
                    daemon.poll_once()
                    if (i + 1) % scrape_every == 0 or (scrape_every > n and i == n - 1):
                        scrape()
                spent = {k: (v - before.get(k, 0.0)) / n * 1000 for k, v in clock.cpu.items()}
                if scrape_every > n:  # one scrape in a batch shorter than the scrape interval: its share
                    spent["render"] *= n / scrape_every
                rows.append(_parts(spent, (time.process_time() - c0) / n * 1000, (backend.cpu - b0) / n * 1000,
                                   (backend.calls - k0) / n * per_call * 1000))
        finally:
            daemon.close()
    return min(rows, key=lambda r: r["daemon"])


def _parts(per: dict[str, float], total: float, back: float, profiler: float) -> dict[str, float]:
    """The parts of one batch (ms per poll) from the wrapped methods' CPU and the process's;
    ``profiler``: the timing wrappers' own CPU around the backend's calls (:func:`timing_cost`),
    spent where the NVML source makes them."""
    others = total - per["loop"] - per["render"]  # NVML workers, the HTTP and event threads
    out = {
        "backend": back,
        "nvml_source": per["nvml_main"] + others - back - profiler,
        "rules": per["rules"],
        "state": per["loop"] - per["nvml_main"] - per["rules"] - per["publish"] + per["status"],
        "metrics": per["publish"] - per["status"] + per["render"],
        "profiler": profiler,
        "total": total,
    }
    out["daemon"] = total - back - profiler
    return out


FEEDER = r"""
import os, sys, time
path, rate, seconds, bus = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
fd = os.open(path, os.O_WRONLY)
n, start = 0, time.monotonic()
total = int(rate * seconds)
while n < total:
    due = int((time.monotonic() - start) * rate) + 1
    batch = []
    while n < min(due, total):
        n += 1
        batch.append(f"3,{n},{n * 1000},-;NVRM: Xid (PCI:{bus}): 13, pid=4242, name=python, Graphics SM Warp Exception\n")
    if batch:
        os.write(fd, "".join(batch).encode())
    time.sleep(0.01)
os.close(fd)
print(n)
"""


class RecordReads:
    """``os.read`` over a FIFO as /dev/kmsg answers it: one whole record a read (a FIFO hands out
    whatever bytes are buffered, cutting records at any byte). BlockingIOError when no whole record
    is buffered; b"" at the end."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0  # the next record starts here (no copy of the rest per record: the harness's own
        # cost would be charged to the daemon's reader thread)

    def __call__(self, fd: int, size: int) -> bytes:
        end = self._buf.find(b"\n", self._pos)
        while end < 0:
            data = os.read(fd, 65536)  # BlockingIOError when empty, b"" when the writer is gone
            if not data:
                if self._pos < len(self._buf):
                    raise BlockingIOError
                return b""
            self._buf, self._pos = self._buf[self._pos:] + data, 0
            end = self._buf.find(b"\n")
        record, self._pos = self._buf[self._pos:end + 1], end + 1
        return record


def storm(gpus: int, rate: float, seconds: float, call_cost: float) -> dict[str, float]:
    """The share of a core the daemon's loop uses at 1 Hz, quiet and under ``rate`` Xid records a
    second, and whether every Xid reached the policy's counts."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir=RUNTIME_ROOT) as run:
        fifo = Path(d) / "kmsg"
        os.mkfifo(fifo)
        xid = XidSource(use_ebpf=False, kmsg_fallback=True, kmsg_path=str(fifo), kmsg_read=RecordReads())
        daemon, backend = _daemon(Path(d), Path(run) / "run", gpus, call_cost, [xid])
        daemon.start()
        loop = threading.Thread(target=daemon.run, name="bench-loop", daemon=True)
        loop.start()
        try:
            time.sleep(2.0)
            quiet_s = min(seconds, 10.0)
            b0, c0 = backend.cpu, time.process_time()
            time.sleep(quiet_s)
            quiet = (time.process_time() - c0) / quiet_s
            quiet_backend = (backend.cpu - b0) / quiet_s
            bus = daemon.nvml.gpus[0].pci_bus_id
            feeder = subprocess.Popen([sys.executable, "-c", FEEDER, str(fifo), str(rate), str(seconds), bus],
                                      stdout=subprocess.PIPE, text=True)
            b0, c0, t0 = backend.cpu, time.process_time(), time.monotonic()
            sent = int(feeder.communicate(timeout=seconds * 3 + 60)[0].strip() or 0)
            time.sleep(1.5)  # the last records reach the next poll
            span = time.monotonic() - t0
            busy = (time.process_time() - c0) / span
            busy_backend = (backend.cpu - b0) / span
        finally:
            daemon.stop()
            loop.join(timeout=10)
            daemon.close()
        counted = sum(daemon.policy_state.xid_counts.get(0, {}).values())
        lost = xid.kmsg.lost if xid.kmsg is not None else float("nan")
    return {"sent": sent, "counted": counted, "lost": lost, "seconds": span,
            "quiet_percent": quiet * 100, "storm_percent": busy * 100,
            "quiet_daemon_percent": (quiet - quiet_backend) * 100, "storm_daemon_percent": (busy - busy_backend) * 100}
