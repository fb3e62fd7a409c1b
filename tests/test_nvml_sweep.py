"""The NVML source's sweep: one thread reads every GPU of a poll, and a call that holds it up
hands the GPUs after it to their own workers, so a hung or slow GPU never costs the others
their reading (issue 45: 64 worker hand-offs a poll were half the daemon's CPU at 64 GPUs)."""

from __future__ import annotations

import threading
import time

import pynvml

from fake_pynvml import FakePynvml
from sentinel.sources.nvml import NvmlSource
from sentinel.sources.nvml_worker import SWEEPERS


class ThreadsSeen(FakePynvml):
    """Records which thread made each device call after ``watch`` is set."""

    def __init__(self, gpus: int) -> None:
        super().__init__(gpus)
        self.watch = False
        self.threads: set[str] = set()

    def _respond(self, h, b, default):
        if self.watch:
            self.threads.add(threading.current_thread().name)
        return super()._respond(h, b, default)


def _sweep_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The sweep threads started since ``before`` (other tests' sources keep their idle ones)."""
    return [t for t in threading.enumerate() if t.name.startswith("sentinel-nvml-sweep") and t not in before]


def _complete(g) -> bool:
    return not g.hung and not g.lost and g.errors == {} and g.values["temperature_celsius"] == 40 and len(g.nvlink) == 8


def test_a_healthy_poll_reads_every_gpu_on_one_sweep_thread():
    fake = ThreadsSeen(8)
    # no call on an idle host runs 2 s: the sweep is never held up, whatever the host's load
    src = NvmlSource(fake, deadline_seconds=30.0, event_wait_ms=20, sweep_call_seconds=2.0)
    src.start()
    try:
        src.poll()
        fake.watch = True
        for _ in range(3):
            r = src.poll()
            assert all(_complete(g) for g in r)
        assert len(fake.threads) == 1 and next(iter(fake.threads)).startswith("sentinel-nvml-sweep"), fake.threads
    finally:
        src.close()


def test_a_hung_gpu_in_the_middle_of_the_sweep_costs_the_gpus_after_it_nothing():
    fake = FakePynvml(4)
    before = set(threading.enumerate())
    src = NvmlSource(fake, deadline_seconds=1.0, event_wait_ms=20)
    src.start()
    try:
        src.poll()
        fake.behaviour[("temperature_celsius", 1)] = "hang"
        t0 = time.monotonic()
        r = src.poll()
        assert time.monotonic() - t0 < 1.0 + 0.25 + 3.0  # the budget plus the hung-call grace, with slack
        assert r[1].hung and all(_complete(r[i]) for i in (0, 2, 3)), [(g.index, g.errors) for g in r]
        for _ in range(3):  # the sweep thread stays inside the hung call: the next polls sweep on another
            t0 = time.monotonic()
            r = src.poll()
            assert time.monotonic() - t0 < 1.0  # the hung GPU is skipped at once, not waited for again
            assert r[1].hung and all(_complete(r[i]) for i in (0, 2, 3))
        assert 2 <= len(_sweep_threads(before)) <= SWEEPERS
        assert src.errors[("deadline", pynvml.NVML_ERROR_TIMEOUT)] == 1
        fake.behaviour.pop(("temperature_celsius", 1))
        fake.release.set()
        end = time.monotonic() + 5
        while not _complete(src.poll()[1]) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(_complete(g) for g in src.poll())
    finally:
        fake.release.set()
        src.close()


def test_every_sweep_thread_held_leaves_the_gpus_to_their_own_workers():
    """More GPUs hung, one after another, than there are sweep threads: the others still read."""
    fake = FakePynvml(SWEEPERS + 3)
    before = set(threading.enumerate())
    src = NvmlSource(fake, deadline_seconds=0.5, event_wait_ms=20)
    src.start()
    try:
        src.poll()
        for hung in range(SWEEPERS + 1):  # each poll, one more GPU hangs and holds the sweep it is on
            fake.behaviour[("temperature_celsius", hung)] = "hang"
            r = src.poll()
            assert all(r[i].hung for i in range(hung + 1))
            assert all(_complete(r[i]) for i in range(hung + 1, len(r))), [(g.index, g.errors) for g in r]
        assert len(_sweep_threads(before)) == SWEEPERS  # one held by each of the first hung GPUs, no more
    finally:
        fake.release.set()
        src.close()
