"""The NVML source's worker threads: one per GPU, running one read at a time under a deadline.

:class:`Worker` runs the calls and says how long the call in flight has run (a call past its
deadline is ``hung``); :class:`PollRead` holds what one GPU's read produced in one poll, and hands
what arrived after the poll reported the GPU to the GPU's next read. Used by
:class:`sentinel.sources.nvml.NvmlSource` only; nothing here knows NVML.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# How far past the poll budget a poll waits to see whether a call in flight passes its own deadline
# (that is, is hung rather than slow); at most a quarter of the deadline.
HUNG_GRACE = 0.1


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


class Worker:
    """One thread per GPU; runs one job at a time and publishes when its current call began.

    One job may wait behind the running one; submitting another replaces the waiting job, which
    is then done (with :class:`Superseded`) without running.
    """

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._job: Job | None = None
        self.call_started: float | None = None
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
        """Run inside a job: marks the call's start so the deadline can be enforced."""
        self.call_started = self._clock()
        try:
            return fn(*args)
        finally:
            self.call_started = None

    def stuck_for(self) -> float:
        """Seconds the call now running has run; 0 between calls."""
        started = self.call_started
        return 0.0 if started is None else self._clock() - started

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

    def wait(self, job: Job, deadline: float) -> bool:
        """Wait for ``job``; False when one of its calls has run past ``deadline`` seconds."""
        while not job.done.wait(timeout=0.05 if self.call_started is None else
                                max(0.001, deadline - (self._clock() - self.call_started))):
            started = self.call_started
            if started is not None and self._clock() - started >= deadline:
                return False
        return True


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

    def finish(self) -> bool:
        """After the last call: True when the read finished before the poll reported it."""
        with self._lock:
            self.finished = not self.closed
            return self.finished

    def close(self) -> tuple[bool, dict[str, float], dict[str, int], dict[tuple[int, str], int]]:
        """Stop the read; (finished, values, errors, nvlink) as they stand now."""
        with self._lock:
            self.closed = True
            return self.finished, dict(self.now["values"]), dict(self.now["errors"]), dict(self.now["links"])

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
