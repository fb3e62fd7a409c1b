"""Common shape of the kernel-event sources (eBPF probes and their fallbacks)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable

from sentinel.readings import KernelEvent, SourceHealth, XidEvent

LabelKey = tuple[str, tuple[tuple[str, str], ...]]


class KernelSource:
    """Collects events from a reader thread; the daemon drains them once per poll (or at once,
    through ``wake``, so a fatal event never waits for the next poll)."""

    name = "kernel"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._xids: list[XidEvent] = []
        self._events: list[KernelEvent] = []
        self.bus_to_gpu: dict[str, int] = {}
        self.wake: Callable[[], None] = lambda: None
        self.counts: Counter[LabelKey] = Counter()
        self.up: dict[str, bool] = {}
        self.detail: dict[str, str] = {}
        self.last_event_time = 0.0

    def set_gpus(self, bus_to_gpu: dict[str, int]) -> None:
        self.bus_to_gpu = dict(bus_to_gpu)

    def push(self, xid: XidEvent | None = None, event: KernelEvent | None = None) -> None:
        with self._lock:
            if xid is not None:
                self._xids.append(xid)
            if event is not None:
                self._events.append(event)
        self.last_event_time = time.monotonic()
        self.wake()

    def drain(self) -> tuple[list[XidEvent], list[KernelEvent]]:
        with self._lock:
            xids, self._xids = self._xids, []
            events, self._events = self._events, []
        return xids, events

    def health(self) -> dict[str, SourceHealth]:
        return {name: SourceHealth(up=up, detail=self.detail.get(name, "")) for name, up in self.up.items()}

    def counters(self) -> dict[LabelKey, float]:
        return {k: float(v) for k, v in self.counts.items()}

    def close(self) -> None:
        return None
