"""The NVML source's Xid event thread: Xid critical errors read through an NVML event set.

Run by :meth:`sentinel.sources.nvml.NvmlSource.start` on a thread of its own; it counts each Xid
per GPU and queues it for the next poll, in the source's own counters and under its locks.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from typing import Any

from sentinel.readings import XidEvent

log = logging.getLogger("sentinel.nvml")


def xid_events(src: Any) -> None:
    """Until ``src._stop`` is set: wait on an event set over ``src``'s GPUs and record each Xid."""
    nvml = src.nvml
    try:
        event_set = nvml.nvmlEventSetCreate()
    except nvml.NVMLError as exc:
        log.warning("NVML event set unavailable (%s); Xids come from the kernel log only", exc)
        return
    by_handle: dict[Any, Any] = {}
    for gpu in src.gpus:
        if gpu.handle is None:
            continue
        try:
            nvml.nvmlDeviceRegisterEvents(gpu.handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            by_handle[handle_key(gpu.handle)] = gpu
        except nvml.NVMLError as exc:
            src._count(("xid_events", int(exc.value)))
    while not src._stop.is_set():
        try:
            data = nvml.nvmlEventSetWait_v2(event_set, src.event_wait_ms)
        except nvml.NVMLError as exc:
            if exc.value != nvml.NVML_ERROR_TIMEOUT:
                src._count(("xid_events", int(exc.value)))
                src._stop.wait(1.0)
            continue
        gpu = by_handle.get(handle_key(data.device))
        xid = int(data.eventData)
        event = XidEvent(gpu=gpu.index if gpu else None, xid=xid, source=src.name,
                         pci_bus_id=gpu.pci_bus_id if gpu else "")
        with src._xid_lock:
            if gpu is not None:
                src._xid_counts.setdefault(gpu.index, Counter())[xid] += 1
            src._xid_events.append(event)
        src.wake()  # decided on now, with the burst it may be part of (the daemon gathers those)
    try:
        nvml.nvmlEventSetFree(event_set)
    except nvml.NVMLError:
        pass  # shutting down; nothing left to free it for


def handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (ctypes pointers compare by address)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle  # a Python object handle (simulated backend, test fakes) hashes by value
