"""The per-rank progress recorder and the hang watch's decisions, on a real c10d store with an
injected clock (one process plays every rank)."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from sentinel.hang import HangSettings
from trainer.progress import HangWatch, Progress, split_steps


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def make(store, clock, rank, world, verdicts, prefix="p"):
    prog = Progress(every=1000, rank=rank, world=world, node=f"n{rank}", clock=clock)
    prog.nodes = {r: f"n{r}" for r in range(world)}
    watch = HangWatch(prog, store, prefix, settings=HangSettings(timeout_seconds=10, gather_seconds=2),
                      on_verdict=verdicts.append, clock=clock)
    return prog, watch


def test_no_suspicion_before_the_first_step_nor_within_t(store):
    clock, verdicts = Clock(), []
    prog, watch = make(store, clock, 0, 2, verdicts)
    clock.t += 3600  # start-up, compile, restore: not a hang
    assert watch.check() is None and watch.suspected_at is None
    prog.on_step(0)
    clock.t += 9
    assert watch.check() is None and watch.suspected_at is None and verdicts == []


def test_a_silent_rank_is_named_and_a_completed_step_ends_the_suspicion(store):
    clock, verdicts = Clock(), []
    p0, w0 = make(store, clock, 0, 3, verdicts)
    p1, w1 = make(store, clock, 1, 3, verdicts)
    for p in (p0, p1):
        p.on_step(4)
    clock.t += 11
    assert w0.check() is None and w1.check() is None  # suspected: reports written, gathering
    clock.t += 2
    v = w0.check()
    assert v is not None and v.kind == "stopped" and v.culprits == (2,) and v.hosts == ("n2",)
    assert w1.check() == v  # the first writer's verdict, for every rank
    p0.on_step(5)
    assert w0.check() is None and w0.verdict is None and w0.suspected_at is None


def test_all_in_one_collective_is_said_but_not_stored(store):
    clock, verdicts = Clock(), []
    watches = [make(store, clock, r, 2, verdicts, prefix="q") for r in range(2)]
    for p, _ in watches:
        p.on_step(7)
    clock.t += 11
    for _, w in watches:
        w.check()
    clock.t += 2
    v = watches[0][1].check()
    assert v.kind == "unknown" and not v.decided
    assert not store.check(["q/verdict/7"])


def test_compute_is_the_step_less_the_waits_for_the_last_rank_to_enter():
    """Two steps of 10 s; this rank entered collectives at 2 s and 7 s of step 1 (the last rank
    entered them at 6 s and 7 s: it waited 4 s) and at 19 s of step 2 (it was the last)."""
    from sentinel.hang import GroupTrace
    from trainer.progress import FR_SLOTS, window_entries

    s = 1_000_000_000
    bounds = [(0, 0, False), (1, 10 * s, False), (2, 20 * s, True)]
    traces = {"default_pg": GroupTrace("0", "default_pg", 4, "gloo:all_reduce", 4, {1: 2 * s, 2: 7 * s, 3: 19 * s, 4: 21 * s}),
              "5": GroupTrace("5", "5", 9, "gloo:all_gather", 9, {9: 3 * s})}
    mine = window_entries(bounds, traces, exclude={"5"})
    assert mine == {1: 2 * s, 2: 7 * s, 3: 19 * s}  # seq 4 is after the window; group 5 is a background one
    assert window_entries(bounds, traces)[5 * FR_SLOTS + 9] == 3 * s  # the same slot on every rank
    latest = {1: 6.0 * s, 2: 7.0 * s, 3: 19.0 * s}
    assert split_steps(bounds, mine, latest) == [(1, 10.0, 6.0, False), (2, 10.0, 10.0, True)]
    assert split_steps(bounds, {}, {}) == []  # no collective compared: the step is left out


def test_a_collective_that_fails_after_the_verdict_leaves_as_the_verdict_says(store):
    """A peer that left on the verdict closes its connections first; this rank's training
    collective then raises before its own watch has left. The exception waits for the verdict
    and the rank leaves with EXIT_HANG (an undecided verdict leaves the exception to Python)."""
    import sys

    from sentinel.hang import Verdict
    from trainer.progress import EXIT_HANG, JobWatch

    exits, shown = [], []
    job = JobWatch(endpoint=None, rank=0, world=1, control_group=None, exit=exits.append,
                   hang=HangSettings(timeout_seconds=10, gather_seconds=0.2))
    clock, verdicts = Clock(), []
    prog, job.watch = make(store, clock, 0, 2, verdicts, prefix="x")
    job.watch.tick = 0.01  # the wait for the watch thread to leave (it never does here) stays short
    before = sys.excepthook
    sys.excepthook = lambda kind, value, tb: shown.append(kind)  # what Python would do: print it
    try:
        job._hold_exceptions()  # what the watch calls on suspicion
        job.watch.verdict = Verdict("stopped", (1,), ("n1",), "rank 1 did not answer")
        sys.excepthook(RuntimeError, RuntimeError("Connection closed by peer"), None)
        assert exits == [EXIT_HANG] and shown == []
        job.watch.verdict = Verdict("unknown", (), (), "every rank in one collective")
        sys.excepthook(RuntimeError, RuntimeError("timeout"), None)
        assert exits == [EXIT_HANG] and shown == [RuntimeError]
        job.close()
        sys.excepthook(ValueError, ValueError("after close"), None)
        assert exits == [EXIT_HANG] and shown == [RuntimeError, ValueError]
    finally:
        sys.excepthook = before
