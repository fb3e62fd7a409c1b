"""NVML source: per-GPU counters through pynvml, every call under a deadline.

Contract
--------
* ``nvmlInit`` runs once per process (in :meth:`NvmlSource.start`); ``nvmlShutdown`` once in
  :meth:`NvmlSource.close`.
* Each field is probed once at start. "Not supported" is remembered and the field is never read
  (nor exported) again; any other error is counted per (field, code) and the field is retried
  on every poll.
* Every NVML call runs on the GPU's own worker thread. :meth:`poll` never blocks for longer than
  ``deadline_seconds`` past the start of a call that does not return: that GPU is then reported
  ``hung`` (a health reading) and is skipped until the stuck call returns.
* Xid critical events are read by an NVML event set on a thread of their own.

The ``nvml`` module is injected: the real ``pynvml``, the simulated backend
(:mod:`sentinel.sources.simulated`) or a test fake with the same functions and error classes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from sentinel.readings import FIELDS, NVLINK_KINDS, GpuReading, XidEvent

log = logging.getLogger("sentinel.nvml")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no library, no driver, no permission)."""


def _retired(cause_name: str) -> Callable[[Any, Any], float]:
    def read(nvml: Any, h: Any) -> float:
        return len(nvml.nvmlDeviceGetRetiredPages(h, getattr(nvml, cause_name)))

    return read


def _ecc(err: str, counter: str) -> Callable[[Any, Any], float]:
    def read(nvml: Any, h: Any) -> float:
        return nvml.nvmlDeviceGetTotalEccErrors(h, getattr(nvml, err), getattr(nvml, counter))

    return read


def _remapped(i: int) -> Callable[[Any, Any], float]:
    return lambda nvml, h: float(nvml.nvmlDeviceGetRemappedRows(h)[i])


def _histogram(name: str) -> Callable[[Any, Any], float]:
    return lambda nvml, h: float(getattr(nvml.nvmlDeviceGetRowRemapperHistogram(h), name))


def _throttle(nvml: Any, h: Any) -> float:
    fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return float(fn(h))


READERS: dict[str, Callable[[Any, Any], float]] = {
    "ecc_corrected_volatile": _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
    "ecc_uncorrected_volatile": _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
    "ecc_corrected_aggregate": _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
    "ecc_uncorrected_aggregate": _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
    "retired_pages_sbe": _retired("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
    "retired_pages_dbe": _retired("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"),
    "retired_pages_pending": lambda nvml, h: float(
        nvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == nvml.NVML_FEATURE_ENABLED
    ),
    "remapped_rows_correctable": _remapped(0),
    "remapped_rows_uncorrectable": _remapped(1),
    "remapped_rows_pending": _remapped(2),
    "remapped_rows_failure": _remapped(3),
    "remap_histogram_max": _histogram("max"),
    "remap_histogram_high": _histogram("high"),
    "remap_histogram_partial": _histogram("partial"),
    "remap_histogram_low": _histogram("low"),
    "remap_histogram_none": _histogram("none"),
    "pcie_replay": lambda nvml, h: float(nvml.nvmlDeviceGetPcieReplayCounter(h)),
    "pcie_link_gen": lambda nvml, h: float(nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
    "pcie_link_width": lambda nvml, h: float(nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
    "temperature_celsius": lambda nvml, h: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
    "slowdown_temperature_celsius": lambda nvml, h: float(
        nvml.nvmlDeviceGetTemperatureThreshold(h, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
    ),
    "power_watts": lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
    "throttle_reasons": _throttle,
}
assert tuple(READERS) == FIELDS, "READERS must cover FIELDS in order"

NVLINK_COUNTERS = {
    "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}
assert set(NVLINK_COUNTERS) == set(NVLINK_KINDS)


class _Hung(Exception):
    """A call passed its deadline (internal)."""


@dataclass
class _Job:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class _Worker:
    """One thread per GPU; runs one job at a time and publishes when its current call began."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._job: _Job | None = None
        self.call_started: float | None = None
        self.busy = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> _Job:
        job = _Job(fn)
        with self._cv:
            self.busy = True
            self._job = job
            self._cv.notify()
        return job

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run inside a job: marks the call's start so the deadline can be enforced."""
        self.call_started = self._clock()
        try:
            return fn(*args)
        finally:
            self.call_started = None

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None:
                    self._cv.wait()
                job = self._job
                self._job = None
            try:
                job.result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting poller
                job.error = exc
            self.busy = False
            job.done.set()

    def wait(self, job: _Job, deadline: float) -> bool:
        """Wait for ``job``; False when one of its calls has run past ``deadline`` seconds."""
        while not job.done.wait(timeout=0.05 if self.call_started is None else
                                max(0.001, deadline - (self._clock() - self.call_started))):
            started = self.call_started
            if started is not None and self._clock() - started >= deadline:
                return False
        return True


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    pci_bus_id: str
    name: str
    serial: str
    worker: _Worker
    supported: list[str] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    nvlinks: list[int] = field(default_factory=list)
    lost: bool = False
    pending: _Job | None = None  # a job still stuck in a hung call


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Reads every GPU of the node through an NVML-compatible module."""

    name = "nvml"

    def __init__(
        self,
        nvml: Any,
        *,
        deadline_seconds: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        event_wait_ms: int = 500,
        source_name: str = "nvml",
    ) -> None:
        self.nvml = nvml
        self.deadline = deadline_seconds
        self.clock = clock
        self.event_wait_ms = event_wait_ms
        self.name = source_name
        self.driver_version = ""
        self.gpus: list[_Gpu] = []
        self.errors: Counter[tuple[str, int]] = Counter()
        self._xid_lock = threading.Lock()
        self._xid_counts: dict[int, Counter[int]] = {}
        self._xid_events: list[XidEvent] = []
        self._stop = threading.Event()
        self._event_thread: threading.Thread | None = None
        self._control = _Worker("sentinel-nvml-init", clock)

    # -- start --------------------------------------------------------------------------------
    def _deadline_call(self, worker: _Worker, fn: Callable[..., Any], *args: Any) -> Any:
        job = worker.submit(lambda: worker.call(fn, *args))
        if not worker.wait(job, self.deadline):
            raise _Hung(getattr(fn, "__name__", "nvml call"))
        if job.error is not None:
            raise job.error
        return job.result

    def start(self) -> None:
        """nvmlInit, enumerate GPUs, probe every field once, start the Xid event thread.

        Raises NvmlUnavailable when NVML cannot be used at all.
        """
        nvml = self.nvml
        try:
            self._deadline_call(self._control, nvml.nvmlInit)
        except _Hung:
            raise NvmlUnavailable(f"nvmlInit did not return within {self.deadline:g} s") from None
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
        try:
            self.driver_version = _text(self._deadline_call(self._control, nvml.nvmlSystemGetDriverVersion))
            count = self._deadline_call(self._control, nvml.nvmlDeviceGetCount)
        except _Hung:
            raise NvmlUnavailable(f"NVML device enumeration did not return within {self.deadline:g} s") from None
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML device enumeration failed ({exc})") from None
        for index in range(count):
            worker = _Worker(f"sentinel-nvml-gpu{index}", self.clock)
            gpu = _Gpu(index, None, f"unknown-{index}", "", "", "", worker)
            self.gpus.append(gpu)
            job = worker.submit(lambda g=gpu: self._probe(g))
            if not worker.wait(job, self.deadline):
                gpu.pending = job
                log.warning("nvml probe of GPU %d hung", index)
            elif job.error is not None:
                log.warning("nvml probe of GPU %d failed: %s", index, job.error)
        self._event_thread = threading.Thread(target=self._events, name="sentinel-nvml-events", daemon=True)
        self._event_thread.start()

    def _probe(self, gpu: _Gpu) -> None:
        nvml, w = self.nvml, gpu.worker
        try:
            gpu.handle = w.call(nvml.nvmlDeviceGetHandleByIndex, gpu.index)
        except nvml.NVMLError as exc:
            self._record_error(gpu, "handle", exc)
            return
        for attr, fn in (
            ("uuid", nvml.nvmlDeviceGetUUID),
            ("name", nvml.nvmlDeviceGetName),
            ("serial", nvml.nvmlDeviceGetSerial),
        ):
            try:
                setattr(gpu, attr, _text(w.call(fn, gpu.handle)))
            except nvml.NVMLError as exc:
                self._record_error(gpu, attr, exc)
        try:
            gpu.pci_bus_id = normalize_bus_id(_text(w.call(nvml.nvmlDeviceGetPciInfo, gpu.handle).busId))
        except nvml.NVMLError as exc:
            self._record_error(gpu, "pci_info", exc)
        for name, reader in READERS.items():
            try:
                w.call(reader, nvml, gpu.handle)
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    gpu.unsupported.add(name)
                    continue
                self._record_error(gpu, name, exc)
            gpu.supported.append(name)
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if w.call(nvml.nvmlDeviceGetNvLinkState, gpu.handle, link) == nvml.NVML_FEATURE_ENABLED:
                    gpu.nvlinks.append(link)
            except nvml.NVMLError as exc:
                if exc.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                    self._record_error(gpu, "nvlink_state", exc)
        if not gpu.nvlinks:
            gpu.unsupported.add("nvlink")
        if gpu.unsupported:
            log.info("GPU %d: not supported: %s", gpu.index, ", ".join(sorted(gpu.unsupported)))

    def _record_error(self, gpu: _Gpu, fieldname: str, exc: Any) -> None:
        code = int(getattr(exc, "value", -1))
        self.errors[(fieldname, code)] += 1
        if code == self.nvml.NVML_ERROR_GPU_IS_LOST:
            gpu.lost = True

    # -- poll ---------------------------------------------------------------------------------
    def _read(self, gpu: _Gpu) -> tuple[dict[str, float], dict[str, int], dict[tuple[int, str], int]]:
        nvml, w = self.nvml, gpu.worker
        values: dict[str, float] = {}
        errors: dict[str, int] = {}
        links: dict[tuple[int, str], int] = {}
        if gpu.handle is None:
            self._probe(gpu)
            if gpu.handle is None:
                return values, {"handle": -1}, links
        lost = False
        for name in gpu.supported:
            try:
                values[name] = float(w.call(READERS[name], nvml, gpu.handle))
            except nvml.NVMLError as exc:
                errors[name] = int(exc.value)
                self._record_error(gpu, name, exc)
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    lost = True
                    break
        if not lost:
            for link in gpu.nvlinks:
                for kind, const in NVLINK_COUNTERS.items():
                    try:
                        links[(link, kind)] = int(
                            w.call(nvml.nvmlDeviceGetNvLinkErrorCounter, gpu.handle, link, getattr(nvml, const))
                        )
                    except nvml.NVMLError as exc:
                        errors[f"nvlink_{kind}"] = int(exc.value)
                        self._record_error(gpu, f"nvlink_{kind}", exc)
        gpu.lost = lost
        return values, errors, links

    def poll(self) -> list[GpuReading]:
        """One reading per GPU; returns within about ``deadline_seconds`` whatever NVML does."""
        jobs: list[tuple[_Gpu, _Job | None]] = []
        for gpu in self.gpus:
            if gpu.pending is not None and not gpu.pending.done.is_set():
                jobs.append((gpu, None))  # still stuck in an earlier call
                continue
            gpu.pending = None
            jobs.append((gpu, gpu.worker.submit(lambda g=gpu: self._read(g))))
        readings = []
        for gpu, job in jobs:
            hung = job is None or not gpu.worker.wait(job, self.deadline)
            values: dict[str, float] = {}
            errors: dict[str, int] = {}
            links: dict[tuple[int, str], int] = {}
            if hung:
                if job is not None:
                    gpu.pending = job
                    self.errors[("deadline", self.nvml.NVML_ERROR_TIMEOUT)] += 1
            elif job.error is not None:
                log.error("GPU %d read failed: %r", gpu.index, job.error)
                errors["read"] = -1
            else:
                values, errors, links = job.result
            with self._xid_lock:
                xids = dict(self._xid_counts.get(gpu.index, {}))
            readings.append(
                GpuReading(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    pci_bus_id=gpu.pci_bus_id,
                    name=gpu.name,
                    serial=gpu.serial,
                    values=values,
                    unsupported=frozenset(gpu.unsupported),
                    errors=errors,
                    nvlink=links,
                    xid_counts=xids,
                    lost=gpu.lost,
                    hung=hung,
                )
            )
        return readings

    def drain_xid_events(self) -> list[XidEvent]:
        with self._xid_lock:
            events, self._xid_events = self._xid_events, []
        return events

    # -- Xid events ---------------------------------------------------------------------------
    def _events(self) -> None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set unavailable (%s); Xids come from the kernel log only", exc)
            return
        by_handle: dict[Any, _Gpu] = {}
        for gpu in self.gpus:
            if gpu.handle is None:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(gpu.handle, nvml.nvmlEventTypeXidCriticalError, event_set)
                by_handle[_handle_key(gpu.handle)] = gpu
            except nvml.NVMLError as exc:
                self.errors[("xid_events", int(exc.value))] += 1
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(event_set, self.event_wait_ms)
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_TIMEOUT:
                    self.errors[("xid_events", int(exc.value))] += 1
                    self._stop.wait(1.0)
                continue
            gpu = by_handle.get(_handle_key(data.device))
            xid = int(data.eventData)
            event = XidEvent(gpu=gpu.index if gpu else None, xid=xid, source=self.name,
                             pci_bus_id=gpu.pci_bus_id if gpu else "")
            with self._xid_lock:
                if gpu is not None:
                    self._xid_counts.setdefault(gpu.index, Counter())[xid] += 1
                self._xid_events.append(event)
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError:
            pass  # shutting down; nothing left to free it for

    def close(self) -> None:
        self._stop.set()
        if self._event_thread is not None:
            self._event_thread.join(timeout=self.event_wait_ms / 1000 + 1)
        try:
            job = self._control.submit(self.nvml.nvmlShutdown)
            self._control.wait(job, self.deadline)
        except self.nvml.NVMLError:
            pass  # at exit a failed shutdown changes nothing


def _handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (ctypes pointers compare by address)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle  # a Python object handle (simulated backend, test fakes) hashes by value


def normalize_bus_id(bus_id: str) -> str:
    """NVML reports 00000000:3B:00.0; the kernel logs 0000:3b:00.0 (or 0000:3b:00). Compare as 0000:3b:00.0."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
        domain = domain[-4:].rjust(4, "0")
    elif len(parts) == 2:
        domain, (bus, devfn) = "0000", parts
    else:
        return text
    if "." not in devfn:
        devfn += ".0"
    return f"{domain}:{bus.rjust(2, '0')}:{devfn}"
