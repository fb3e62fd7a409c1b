"""NVML source: per-GPU counters through pynvml, every call under a deadline.

Contract
--------
* ``nvmlInit`` runs once per process (in :meth:`NvmlSource.start`); ``nvmlShutdown`` once in
  :meth:`NvmlSource.close`.
* The fields are those declared in :mod:`sentinel.fields` when the source is built; each
  field's reader comes from its declaration.
* Each field is probed once at start. "Not supported" is remembered and the field is never read
  (nor exported) again; any other error is counted per (field, code) and the field is retried
  on every poll.
* Fields with an NVML field id and the NVLink counters are read with nvmlDeviceGetFieldValues
  (:mod:`sentinel.sources.nvml_batch`); a kind's per-link NVLink counters only when its total
  moved, so the rules, which sum them per kind, see what a read of every link gives.
* NVML calls run off the polling thread: one sweep thread reads the GPUs one after another; when
  a call holds it up, the GPUs it has not begun are read in parallel by their own worker threads.
* ``deadline_seconds`` is each GPU's budget for a whole poll: :meth:`poll` returns within about
  that (at most a quarter, and 0.1 s, more) however slow or stuck the GPUs are. A GPU whose read
  did not finish in the budget is reported with the values it did read (NVLink counters only
  when all were read), the rest missing, and ``errors["poll_budget"] = NVML_ERROR_TIMEOUT``
  (counted as ``("poll_budget", 10)``); its next read resumes after the last call that returned.
* Slow is not ``hung``. ``hung`` (a health reading: the policy's ``nvml_hung`` rule migrates
  on it) means one call ran past the deadline; such a call is counted once as
  ``("deadline", 10)`` and the GPU is skipped until the call returns.
* Xid critical events are read by an NVML event set on a thread of their own.

The ``nvml`` module is injected: the real ``pynvml``, the simulated backend
(:mod:`sentinel.sources.simulated`) or a test fake with the same functions and error classes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from sentinel import fields as nvml_fields
from sentinel.readings import GpuReading, XidEvent, sum_links
from sentinel.sources.nvml_batch import NVLINK_COUNTERS, FieldValues, LinkGate
from sentinel.sources.nvml_events import xid_events
from sentinel.sources.nvml_worker import (HUNG_GRACE, SWEEP_CALL_SECONDS, SWEEPERS, CallClock, Hung, Job, PollRead,
                                          Sweep, Worker)
from sentinel.pci import normalize_bus_id  # noqa: F401 - the one normaliser; re-exported for callers

log = logging.getLogger("sentinel.nvml")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine (no library, no driver, no permission)."""


@dataclass
class _Gpu:
    index: int
    handle: Any
    uuid: str
    pci_bus_id: str
    name: str
    serial: str
    worker: Worker
    calls: CallClock  # the GPU's call in flight, on whichever thread reads it (its sweep, its worker)
    supported: list[str] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    nvlinks: list[int] = field(default_factory=list)
    # batched reads (sentinel/sources/nvml_batch.py): entries read every poll, in chunks of
    # FIELD_VALUES_PER_CALL; the per-link NVLink counters read when their totals moved
    batch: list[list[tuple[str, Any, tuple[int, int]]]] = field(default_factory=list)
    links: LinkGate | None = None
    link_calls: list[tuple[int, str]] = field(default_factory=list)  # NVLink counters read one call each
    link_count: int = 0  # NVLink counters one complete read returns
    lost: bool = False
    pending: Job | None = None  # the latest job, until it is done
    cut_short: PollRead | None = None  # the last read, when the poll budget ended it
    counted_stuck_call: float | None = None  # start time of the stuck call already counted
    items: list[tuple[str, Any]] | None = None  # the calls of one read, once probed (NvmlSource._items)


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
        batch: bool = True,
        sweep_call_seconds: float = SWEEP_CALL_SECONDS,
        nvlink_totals: bool = True,
    ) -> None:
        self.nvml = nvml
        # read every field that has an NVML field id, and the NVLink counters, through
        # nvmlDeviceGetFieldValues (one call per GPU per poll); False: one call per field and counter
        self.batch = batch
        # with batch: the per-link NVLink counters read only when their totals moved (nvml_batch.py)
        self._values = FieldValues(nvml, self._record_error, totals=nvlink_totals)
        self.deadline = deadline_seconds
        self.sweep_call = sweep_call_seconds  # a sweep call this long hands the GPUs after it to their workers
        self.clock = clock
        self.event_wait_ms = event_wait_ms
        self.name = source_name
        # field -> reader, in probe order, from the declarations in sentinel/fields.py
        self.readers: dict[str, Callable[[Any, Any], float]] = {f.name: f.read for f in nvml_fields.NVML_FIELDS if f.call}
        self.declared = {f.name: f for f in nvml_fields.NVML_FIELDS}
        self.driver_version = ""
        self.gpus: list[_Gpu] = []
        self.errors: Counter[tuple[str, int]] = Counter()
        self._errors_lock = threading.Lock()
        self._xid_lock = threading.Lock()
        self._xid_counts: dict[int, Counter[int]] = {}
        self._xid_events: list[XidEvent] = []
        # called by the Xid event thread for each Xid it records: the daemon decides on it at once
        # (Daemon.start sets it to its loop's wake), not at its next poll (1 s by default)
        self.wake: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._event_thread: threading.Thread | None = None
        self._control = Worker("sentinel-nvml-init", clock)
        self._calls: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}  # see _resolved
        self._sweepers: list[tuple[Worker, Job | None]] = []  # sweep threads and their latest jobs

    # -- start --------------------------------------------------------------------------------
    def _deadline_call(self, worker: Worker, fn: Callable[..., Any], *args: Any) -> Any:
        job = worker.submit(lambda: worker.call(fn, *args))
        if not worker.wait(job, self.deadline):
            raise Hung(getattr(fn, "__name__", "nvml call"))
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
        except Hung:
            raise NvmlUnavailable(f"nvmlInit did not return within {self.deadline:g} s") from None
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from None
        try:
            self.driver_version = _text(self._deadline_call(self._control, nvml.nvmlSystemGetDriverVersion))
            count = self._deadline_call(self._control, nvml.nvmlDeviceGetCount)
        except Hung:
            raise NvmlUnavailable(f"NVML device enumeration did not return within {self.deadline:g} s") from None
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML device enumeration failed ({exc})") from None
        probes = []
        for index in range(count):
            worker = Worker(f"sentinel-nvml-gpu{index}", self.clock)
            gpu = _Gpu(index, None, f"unknown-{index}", "", "", "", worker, CallClock(self.clock))
            self.gpus.append(gpu)
            probes.append((gpu, worker.submit(lambda g=gpu: self._probe(g))))
        for gpu, job in probes:  # GPUs are probed in parallel: one slow GPU does not delay the others
            if not gpu.worker.wait(job, self.deadline, gpu.calls):
                gpu.pending = job
                log.warning("nvml probe of GPU %d hung", gpu.index)
            elif job.error is not None:
                log.warning("nvml probe of GPU %d failed: %s", gpu.index, job.error)
        self._event_thread = threading.Thread(target=xid_events, args=(self,), name="sentinel-nvml-events", daemon=True)
        self._event_thread.start()

    def _probe(self, gpu: _Gpu) -> None:
        nvml, w = self.nvml, gpu.calls
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
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if w.call(nvml.nvmlDeviceGetNvLinkState, gpu.handle, link) == nvml.NVML_FEATURE_ENABLED:
                    gpu.nvlinks.append(link)
            except nvml.NVMLError as exc:
                if exc.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                    self._record_error(gpu, "nvlink_state", exc)
        batched, batch_unsupported = self._values.probe(gpu) if self.batch else (set(), set())
        for name, f in self.declared.items():
            if name in batched:
                gpu.supported.append(name)
                continue
            if not f.call:
                gpu.unsupported.add(name)  # a field value only (the recovery action): no other way to read it
                continue
            try:
                w.call(self.readers[name], nvml, gpu.handle)
            except nvml.NVMLError as exc:
                if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                    gpu.unsupported.add(name)
                    continue
                self._record_error(gpu, name, exc)
            gpu.supported.append(name)
        batched_links = {key for chunk in gpu.batch for what, key, _ in chunk if what == "link"}
        for link in gpu.nvlinks:
            for kind, const in NVLINK_COUNTERS.items():
                if (link, kind) in batched_links:
                    continue
                try:
                    w.call(nvml.nvmlDeviceGetNvLinkErrorCounter, gpu.handle, link, getattr(nvml, const))
                except nvml.NVMLError as exc:
                    if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                        continue  # this link has no such counter (NVLink 4: no data CRC): never read
                    self._record_error(gpu, f"nvlink_{kind}", exc)
                gpu.link_calls.append((link, kind))
        if self.batch:
            self._values.gate(gpu, gpu.link_calls)
        gpu.link_count = (len(gpu.link_calls) + (gpu.links.count if gpu.links else 0)
                          + sum(1 for chunk in gpu.batch for what, _, _ in chunk if what == "link"))
        if not gpu.nvlinks:
            gpu.unsupported.add("nvlink")
        if gpu.unsupported:
            log.info("GPU %d: not supported: %s", gpu.index, ", ".join(sorted(gpu.unsupported)))

    def _read_group(self, gpu: _Gpu, names: list[str], read: PollRead) -> bool:
        """One call for the fields that share it (each takes its part); True when the GPU is lost."""
        nvml = self.nvml
        fn, args = self._resolved(self.declared[names[0]])
        try:
            raw = gpu.calls.call(fn, gpu.handle, *args)
        except nvml.NVMLError as exc:
            for name in names:
                read.put("errors", name, int(exc.value))
                self._record_error(gpu, name, exc)
            return exc.value == nvml.NVML_ERROR_GPU_IS_LOST
        for name in names:
            f = self.declared[name]
            read.put("values", name, float(f.codec.decode(nvml, nvml_fields.pick(raw, f.part))))
        return False

    def _resolved(self, f: nvml_fields.NvmlField) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``f``'s pynvml function and constant arguments, looked up in the module once, not each poll."""
        hit = self._calls.get(f.name)
        if hit is None:
            hit = self._calls[f.name] = (f.function(self.nvml), tuple(getattr(self.nvml, a) for a in f.args))
        return hit

    def _count(self, key: tuple[str, int]) -> None:
        with self._errors_lock:  # GPU workers count concurrently
            self.errors[key] += 1

    def _record_error(self, gpu: _Gpu, fieldname: str, exc: Any) -> None:
        code = int(getattr(exc, "value", -1))
        self._count((fieldname, code))
        if code == self.nvml.NVML_ERROR_GPU_IS_LOST:
            gpu.lost = True

    # -- poll ---------------------------------------------------------------------------------
    def _read(self, gpu: _Gpu, read: PollRead, cut_short: PollRead | None) -> None:
        """One poll's read of one GPU, into ``read``; stops when the poll closes ``read``.

        Fields and NVLink counters are read as a ring. After a read cut short by the poll
        budget, the next one starts after the last call that returned, so a slow GPU still has
        every field read over a few polls.
        """
        nvml, w = self.nvml, gpu.calls
        if gpu.handle is None:
            self._probe(gpu)  # not cut short: a half-done probe would lose fields for good
            if gpu.handle is None:
                read.put("errors", "handle", -1)
                read.finish()
                return
        if gpu.items is None:  # what the probe found does not change: the calls are listed once
            gpu.items = self._items(gpu)
        items = gpu.items
        first = cut_short.resume(read, len(items)) if cut_short is not None else 0
        lost = False
        for step in range(len(items)):
            position = (first + step) % len(items)
            if not read.begin(position):
                return  # this poll has reported the GPU already
            name, link = items[position]
            if name == "field_values":
                if self._values.read(gpu, link, read):
                    lost = True
                    break
                continue
            if name == "nvlink_links":
                if self._values.read_links(gpu, read):
                    lost = True
                    break
                continue
            if isinstance(link, tuple) and link[0] == "group":
                if self._read_group(gpu, link[1], read):
                    lost = True
                    break
                continue
            try:
                if link is None:
                    f = self.declared[name]
                    fn, args = self._resolved(f)
                    read.put("values", name, float(f.codec.decode(nvml, nvml_fields.pick(w.call(fn, gpu.handle, *args),
                                                                                           f.part))))
                else:
                    value = w.call(nvml.nvmlDeviceGetNvLinkErrorCounter, gpu.handle, link[0], getattr(nvml, link[2]))
                    read.put("links", (link[0], link[1]), int(value))
            except nvml.NVMLError as exc:
                read.put("errors", name, int(exc.value))
                self._record_error(gpu, name, exc)
                if exc.value == nvml.NVML_ERROR_GPU_IS_LOST:
                    lost = True
                    break
        gpu.lost = lost
        read.finish(sum_links)

    def _items(self, gpu: _Gpu) -> list[tuple[str, Any]]:
        """The calls of one read of ``gpu``, in ring order (see :meth:`_read`)."""
        batched = {key for chunk in gpu.batch for what, key, _ in chunk if what == "field"}
        items: list[tuple[str, Any]] = [("field_values", chunk) for chunk in gpu.batch]
        if gpu.links is not None:  # right after the totals it compares
            items.append(("nvlink_links", gpu.links))
        if self.batch:  # fields that share one call (the remapper histogram's five) make it once
            groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
            for name in gpu.supported:
                if name not in batched:
                    f = self.declared[name]
                    groups.setdefault((f.call, f.args), []).append(name)
            items += [(names[0], ("group", names)) if len(names) > 1 else (names[0], None) for names in groups.values()]
        else:
            items += [(name, None) for name in gpu.supported if name not in batched]
        items += [(f"nvlink_{kind}", (link, kind, NVLINK_COUNTERS[kind])) for link, kind in gpu.link_calls]
        return items

    def poll(self) -> list[GpuReading]:
        """One reading per GPU, within about ``deadline_seconds`` whatever NVML does.

        The deadline is each GPU's budget for the whole poll, not only for one call. One sweep
        thread reads the GPUs one after another (one thread hand-off a poll); when one of its
        calls runs past ``sweep_call_seconds`` (a real call takes tens of microseconds) or the
        sweep past a quarter of the budget, the GPUs it has not begun are read in parallel by
        their own workers. A GPU whose read has not finished when the budget ends is reported
        with what it read so far (the rest missing, never 0) and ``errors["poll_budget"] =
        NVML_ERROR_TIMEOUT``; its read stops after the call in flight, and the next one waits
        behind that call. It is ``hung`` only when one call has run past the deadline; the poll
        waits up to ``HUNG_GRACE`` past the budget to see a call that is about to cross that
        line. A GPU still inside such a call is skipped at once (``hung``) until the call returns.
        """
        deadline = self.deadline
        budget_end, reads = self.clock() + deadline, []  # reads: (GPU, its job, its read)
        swept: list[int] = []  # positions in reads of the GPUs the sweep is to read
        for gpu in self.gpus:
            pending = gpu.pending
            if pending is not None and pending.done.is_set():
                pending = gpu.pending = None
            if pending is not None and gpu.calls.stuck_for() >= deadline:
                reads.append((gpu, None, None))  # still inside a call that passed its deadline
                continue
            read = PollRead()
            if pending is None:
                swept.append(len(reads))
                reads.append((gpu, None, read))
            else:  # the last read is still in its last call: this one waits behind it, on the GPU's worker
                reads.append((gpu, self._alone(gpu, read, pending), read))
        if swept:
            self._sweep(reads, swept, budget_end)
        self._wait(reads, budget_end, deadline)
        return [self._reading(gpu, job, read, deadline) for gpu, job, read in reads]

    def _alone(self, gpu: _Gpu, read: PollRead, behind: Job | None = None) -> Job:
        """Submit ``gpu``'s read to its own worker (after ``behind``, a sweep still in its call)."""
        cut, after = gpu.cut_short, behind if behind is not None and behind.sweep else None

        def job() -> None:
            if after is not None:
                after.done.wait()
            self._read(gpu, read, cut)
        gpu.pending = gpu.worker.submit(job)
        return gpu.pending

    def _sweeper(self) -> Worker | None:
        """An idle sweep thread: a new one while every one is held by a slow or hung call (at most
        ``SWEEPERS``; then None and the GPUs are read by their own workers)."""
        for worker, job in self._sweepers:
            if job is None or job.done.is_set():
                return worker
        if len(self._sweepers) < SWEEPERS:
            self._sweepers.append((Worker(f"sentinel-nvml-sweep{len(self._sweepers)}", self.clock), None))
            return self._sweepers[-1][0]
        return None

    def _sweep(self, reads: list[tuple[_Gpu, Job | None, PollRead | None]], swept: list[int],
               budget_end: float) -> None:
        """Read the GPUs at ``swept`` on a sweep thread; those it has not begun when a call holds
        it up go to their own workers. Fills in each one's job in ``reads``."""
        worker = self._sweeper()
        if worker is None:
            for pos in swept:
                gpu, _, read = reads[pos]
                reads[pos] = (gpu, self._alone(gpu, read), read)
            return
        gpus = [reads[pos][0] for pos in swept]
        sweep = Sweep([lambda g=g, r=reads[pos][2], c=g.cut_short: self._swept(g, r, c) for g, pos in zip(gpus, swept)])
        job = worker.submit(sweep.run)
        job.sweep = True
        self._sweepers = [(w, job if w is worker else j) for w, j in self._sweepers]
        slow = min(self.sweep_call, self.deadline / 10)
        give_up = min(self.clock() + self.deadline / 4, budget_end)
        while not job.done.wait(slow):
            at, now = sweep.at, self.clock()
            started = gpus[at].calls.call_started if 0 <= at < len(gpus) else None
            if now >= give_up or (started is not None and now - started >= slow):
                break  # held up: hand the rest to the GPUs' own workers
        begun = sweep.stop()
        for k, (gpu, pos) in enumerate(zip(gpus, swept)):
            read = reads[pos][2]
            if k >= begun:
                reads[pos] = (gpu, self._alone(gpu, read), read)
                continue
            # the last read begun may still be in a call: the GPU's next read waits behind it
            gpu.pending = job if k == begun - 1 else None
            reads[pos] = (gpu, job, read)

    def _swept(self, gpu: _Gpu, read: PollRead, cut: PollRead | None) -> None:
        """One GPU's read in a sweep: its failure is that GPU's, and the sweep goes on."""
        try:
            self._read(gpu, read, cut)
        except Exception as exc:  # noqa: BLE001 - reported as that GPU's failed read
            read.error = exc

    def _wait(self, reads: list[tuple[_Gpu, Job | None, PollRead | None]], budget_end: float, deadline: float) -> None:
        """Wait for the GPUs' reads until the budget ends, and up to ``HUNG_GRACE`` more for a
        call that is about to pass its deadline (hung, not only slow)."""
        for _, job, _ in reads:  # the workers run in parallel: this waits once for all of them
            if job is not None:
                job.done.wait(max(0.0, budget_end - self.clock()))
        grace_end = budget_end + min(HUNG_GRACE, deadline / 4)
        for gpu, job, _ in reads:
            started = gpu.calls.call_started
            if job is None or started is None or started + deadline > grace_end:
                continue
            # Hung or only slow? Watch this one call until it returns or passes its deadline.
            while gpu.calls.call_started == started and not job.done.is_set():
                left = started + deadline - self.clock()
                if left <= 0:
                    break
                job.done.wait(min(left, 0.005))

    def _reading(self, gpu: _Gpu, job: Job | None, read: PollRead | None, deadline: float) -> GpuReading:
        """Close one GPU's read and report what it has (see :meth:`poll`)."""
        values: dict[str, float] = {}
        errors: dict[str, int] = {}
        links: dict[tuple[int, str], int] = {}
        finished = failed = False
        summed = None
        if read is not None:
            finished, values, errors, links = read.close()
            summed = read.summary if finished else None  # sum_links(links), made by the reading thread
            # a sweep's reads keep their own failures (NvmlSource._swept)
            error = read.error or (job.error if job is not None and not job.sweep and job.done.is_set() else None)
            failed = error is not None
            if failed:
                log.error("GPU %d read failed: %r", gpu.index, error)
                errors["read"] = -1
            if finished or failed:
                gpu.cut_short = None
            elif read.began:  # else it waited behind the last one all along: resume from that
                gpu.cut_short = read
        hung = False
        if not finished and not failed:
            started = gpu.calls.call_started
            hung = started is not None and self.clock() - started >= deadline
            if hung and started != gpu.counted_stuck_call:
                gpu.counted_stuck_call = started
                self._count(("deadline", self.nvml.NVML_ERROR_TIMEOUT))
            errors["poll_budget"] = self.nvml.NVML_ERROR_TIMEOUT
            self._count(("poll_budget", self.nvml.NVML_ERROR_TIMEOUT))
            if len(links) < gpu.link_count:
                links = {}  # the policy sums the counters over links: a partial sum would read as a jump
        with self._xid_lock:
            xids = dict(self._xid_counts.get(gpu.index, {}))
        return GpuReading(index=gpu.index, uuid=gpu.uuid, pci_bus_id=gpu.pci_bus_id, name=gpu.name, serial=gpu.serial,
                          values=values, unsupported=frozenset(gpu.unsupported), errors=errors, nvlink=links,
                          xid_counts=xids, lost=gpu.lost, hung=hung, summed=summed)

    def drain_xid_events(self) -> list[XidEvent]:
        with self._xid_lock:
            events, self._xid_events = self._xid_events, []
        return events

    def close(self) -> None:
        self._stop.set()
        if self._event_thread is not None:
            self._event_thread.join(timeout=self.event_wait_ms / 1000 + 1)
        try:
            job = self._control.submit(self.nvml.nvmlShutdown)
            self._control.wait(job, self.deadline)
        except self.nvml.NVMLError:
            pass  # at exit a failed shutdown changes nothing
