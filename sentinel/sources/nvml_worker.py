"""The NVML source's threads: a sweep thread that reads every GPU one after another, and one
worker per GPU that reads it alone when the sweep is held up, each read under a deadline.

:class:`CallClock` says how long the call in flight on one GPU has run, whichever thread makes it
(a call past its deadline is ``hung``); :class:`Worker` runs jobs on its thread; :class:`Sweep` is
one poll's reads of several GPUs on one thread (one hand-off a poll, not one a GPU), which the
poller cuts when a call overruns; :class:`PollRead` holds what one GPU's read produced in one
poll, and hands what arrived after the poll reported the GPU to the GPU's next read. Used by
:class:`sentinel.sources.nvml.NvmlSource` only; nothing here knows NVML.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# How far past the poll budget a poll waits to see whether a call in flight passes its own deadline
# (that is, is hung rather than slow); at most a quarter of the deadline.
HUNG_GRACE = 0.1
# A sweep call that has run this long holds the sweep up: the GPUs it has not begun are read by
# their own workers (a real NVML call takes tens of microseconds; at most a tenth of the deadline).
SWEEP_CALL_SECONDS = 0.05
SWEEPERS = 4  # sweep threads at most (a new one while the others are held by slow or hung calls)


class Hung(Exception):
    """A call passed its deadline (internal)."""


class Superseded(Exception):
    """A queued job that a newer poll replaced before it started (internal)."""


@dataclass
class Job:
    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    sweep: bool = False  # a sweep's job: it reads several GPUs


class CallClock:
    """When the NVML call now running on one GPU (or the control thread) began; None between calls.

    Shared by every thread that reads the GPU (its sweep, its own worker): the deadline is the
    call's, wherever it runs."""

    __slots__ = ("_clock", "call_started")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.call_started: float | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one call, marking its start so the deadline can be enforced."""
        self.call_started = self._clock()
        try:
            return fn(*args)
        finally:
            self.call_started = None

    def stuck_for(self) -> float:
        """Seconds the call now running has run; 0 between calls."""
        started = self.call_started
        return 0.0 if started is None else self._clock() - started


class Worker:
    """A thread that runs one job at a time.

    One job may wait behind the running one; submitting another replaces the waiting job, which
    is then done (with :class:`Superseded`) without running. ``calls`` is the clock of the calls
    made through :meth:`call` (the control thread's; a GPU's reads use the GPU's own clock).
    """

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._job: Job | None = None
        self.calls = CallClock(clock)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        with self._cv:
            replaced, self._job = self._job, job
            self._cv.notify()
        if replaced is not None:
            replaced.error = Superseded()
            replaced.done.set()
        return job

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run inside a job: one call on this worker's own clock."""
        return self.calls.call(fn, *args)

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
            job.done.set()

    def wait(self, job: Job, deadline: float, calls: CallClock | None = None) -> bool:
        """Wait for ``job``; False when one of its calls (timed by ``calls``, this worker's own
        clock by default) has run past ``deadline`` seconds."""
        calls = calls or self.calls
        while True:
            started = calls.call_started
            if job.done.wait(timeout=0.05 if started is None else max(0.001, deadline - (self._clock() - started))):
                return True
            started = calls.call_started
            if started is not None and self._clock() - started >= deadline:
                return False


class Sweep:
    """One poll's reads of several GPUs, one after another on one thread.

    ``reads`` are callables, one GPU's read each, that keep their own failures (a read that
    raises ends the sweep: its job's error). The poller hands the sweep to one thread (one
    hand-off for every GPU) and cuts it (:meth:`stop`) when a call holds it up; the reads it has
    not begun are then the GPUs' own workers' to make.
    """

    def __init__(self, reads: list[Callable[[], None]]) -> None:
        self._lock = threading.Lock()
        self.reads = reads
        self.at = -1  # the read begun last
        self._cut = False

    def run(self) -> None:
        for i, read in enumerate(self.reads):
            with self._lock:
                if self._cut:
                    return
                self.at = i
            read()

    def stop(self) -> int:
        """Begin no further read; returns how many reads were begun (no later one will be). Of
        those, all but the last have ended; the last has ended when the sweep's job is done."""
        with self._lock:
            self._cut = True
            return self.at + 1


class PollRead:
    """What one GPU's read has produced so far in one poll.

    The worker adds results as its calls return; the poller closes the read when it reports the
    GPU. After that the worker makes no further call for this poll. The result of the call that
    was in flight at the close arrives late: it is kept aside and the GPU's next read reports
    it (it is at most one call old), so a GPU whose calls are about as slow as the budget still
    reports something every poll.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = False
        self.finished = False
        self.position = 0  # index of the item read last (or being read)
        self.position_done = False  # whether that call has returned
        self.began = False  # whether any call was made for this read
        self.error: BaseException | None = None  # the read failed (raised): set by the thread reading
        self.summary: Any = None  # see finish
        self.now: dict[str, dict[Any, Any]] = {"values": {}, "errors": {}, "links": {}}
        self.late: dict[str, dict[Any, Any]] = {"values": {}, "errors": {}, "links": {}}

    def begin(self, position: int) -> bool:
        """Before a call: False once the poll has reported this GPU (stop reading)."""
        with self._lock:
            if self.closed:
                return False
            self.position, self.position_done, self.began = position, False, True
            return True

    def put(self, kind: str, key: Any, value: Any) -> None:
        """After a call: its result (``kind`` is values, errors or links)."""
        with self._lock:
            results = self.late if self.closed else self.now
            results[kind][key] = value
            if kind in ("values", "errors"):  # a field read again replaces its older outcome
                results["errors" if kind == "values" else "values"].pop(key, None)
            self.position_done = True

    def put_many(self, values: dict[Any, Any], errors: dict[Any, Any], links: dict[Any, Any]) -> None:
        """After a call that returned several results: each as :meth:`put` would, under one lock."""
        with self._lock:
            into = self.late if self.closed else self.now
            into["links"].update(links)
            for kind, other, results in (("values", "errors", values), ("errors", "values", errors)):
                if results:
                    into[kind].update(results)
                    for key in results:
                        into[other].pop(key, None)
            self.position_done = True

    def finish(self, summarize: Callable[[dict[Any, Any]], Any] | None = None) -> bool:
        """After the last call: True when the read finished before the poll reported it; then
        ``summary`` is ``summarize(links)`` (made on the reading thread, where they are fresh)."""
        with self._lock:
            self.finished = not self.closed
            if self.finished and summarize is not None:
                self.summary = summarize(self.now["links"])
            return self.finished

    def close(self) -> tuple[bool, dict[str, float], dict[str, int], dict[tuple[int, str], int]]:
        """Stop the read; (finished, values, errors, nvlink) as they stand now: the caller's to keep
        (no later result is put into them: it goes to the next read)."""
        with self._lock:
            self.closed = True
            return self.finished, self.now["values"], self.now["errors"], self.now["links"]

    def resume(self, into: PollRead, items: int) -> int:
        """For the GPU's next read, once this read's job has ended: hand over the late result and
        return the item to start from (the one after the last call that returned)."""
        with self._lock:
            late = {kind: dict(results) for kind, results in self.late.items()}
            start = self.position + 1 if self.position_done else self.position
        for kind, results in late.items():
            for key, value in results.items():
                into.put(kind, key, value)
        return start % items if items else 0
