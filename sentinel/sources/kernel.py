"""Common shape of the kernel-event sources (eBPF probes and their fallbacks)."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from sentinel.families import counter
from sentinel.readings import KernelEvent, SourceHealth, XidEvent
from sentinel.sources.ebpf import EbpfUnavailable, RingProbe

log = logging.getLogger("sentinel.kernel")

LabelKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class SignalHealth(SourceHealth):
    """A signal's coverage on this node: ``via`` is the path it is read through (``ebpf``,
    ``kmsg``, ``sysfs``), ``none`` when every path tried failed (exported as
    ``sentinel_source_up{source,via}``)."""

    via: str = "none"


def path_via(path: str) -> str:
    """``ebpf_xid`` -> ``ebpf``, ``sysfs_aer`` -> ``sysfs``, ``kmsg`` -> ``kmsg``."""
    kind, sep, _ = path.partition("_")
    return kind if sep and kind in ("ebpf", "sysfs") else path


EBPF_EVENTS_LOST = counter("sentinel_ebpf_events_lost", "Events the kernel dropped before user space read them", "probe")
KERNEL_EVENTS = counter("sentinel_kernel_events", "Kernel events seen, by source and kind", "source", "kind")


class KernelSource:
    """Collects events from a reader thread; the daemon drains them once per poll (or at once,
    through ``wake``, so a fatal event never waits for the next poll)."""

    name = "kernel"
    FAMILIES: tuple = (EBPF_EVENTS_LOST,)  # a subclass adds the families it counts

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._xids: list[XidEvent] = []
        self._events: list[KernelEvent] = []
        self.bus_to_gpu: dict[str, int] = {}
        self.wake: Callable[[], None] = lambda: None
        self.counts: Counter[LabelKey] = Counter()
        self.up: dict[str, bool] = {}
        self.detail: dict[str, str] = {}
        self.probes: list[Any] = []  # loaded RingProbes, for their lost counters and cleanup

    def load_probe(self, up_name: str, probe: RingProbe) -> RingProbe | None:
        """Start ``probe``; on failure report ``up_name`` down (logged once), never raise."""
        try:
            probe.start()
        except EbpfUnavailable as exc:
            self.up[up_name] = False
            self.detail[up_name] = str(exc)
            log.warning("%s unavailable: %s", up_name, exc)
            return None
        self.probes.append(probe)
        self.up[up_name] = True
        return probe

    def set_gpus(self, bus_to_gpu: dict[str, int]) -> None:
        self.bus_to_gpu = dict(bus_to_gpu)

    def push(self, xid: XidEvent | None = None, event: KernelEvent | None = None) -> None:
        """Queue an event; the first since the last drain wakes the daemon, which drains them all
        (every event queued is followed by a wake: its own, or the one of the first still queued).
        An Xid storm wakes it once a batch, not a thousand times a second."""
        with self._lock:
            first = not self._xids and not self._events
            if xid is not None:
                self._xids.append(xid)
            if event is not None:
                self._events.append(event)
        if first:
            self.wake()

    def drain(self) -> tuple[list[XidEvent], list[KernelEvent]]:
        with self._lock:
            xids, self._xids = self._xids, []
            events, self._events = self._events, []
        return xids, events

    def health(self) -> dict[str, SourceHealth]:
        """This signal's coverage, once, under the source's name: up through the first of its
        paths that works (``up`` lists them in order of preference), down only when every path
        tried failed, or none was (the source never started). A working fallback is not down,
        and a path switched off in config is not a failure: a node is blind only when no path
        sees the signal."""
        for path, ok in self.up.items():
            if ok:
                return {self.name: SignalHealth(up=True, via=path_via(path))}
        why = "; ".join(f"{path}: {self.detail[path]}" for path in self.up if path in self.detail)
        return {self.name: SignalHealth(up=False, via="none", detail=why or "not started")}

    def counters(self) -> dict[LabelKey, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        for probe in self.probes:
            out[EBPF_EVENTS_LOST.key(probe=probe.name)] = float(probe.lost())
        return out

    def close(self) -> None:
        for probe in self.probes:
            probe.close()


def run_alone(prog: str, make: Callable[[argparse.Namespace], KernelSource], describe: Callable[[Any], str],
              add_args: Callable[[argparse.ArgumentParser], None] | None = None, argv: list[str] | None = None) -> int:
    """`python -m sentinel.sources.<probe> -v`: run one source alone and print what it sees."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (0: until Ctrl-C)")
    if add_args:
        add_args(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    src = make(args)
    src.start()
    print(f"{src.name}: up={src.up} {src.detail}", flush=True)
    end = time.time() + args.seconds if args.seconds else float("inf")
    try:
        while time.time() < end:
            xids, events = src.drain()
            for item in [*xids, *events]:
                print(describe(item), flush=True)
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        src.close()
    return 0
