"""An Xid storm's cost in the kernel-event path (issue 45): the daemon is woken once a batch of
events, never losing one; what the storm leaves the policy to decide is tested in test_poll_cost.py."""

from __future__ import annotations

import threading

from sentinel.readings import KernelEvent, XidEvent
from sentinel.sources.kernel import KernelSource


def test_a_burst_wakes_the_daemon_once_and_every_event_queued_is_followed_by_a_wake():
    src = KernelSource()
    wakes = []
    src.wake = lambda: wakes.append(1)
    for i in range(1000):
        src.push(XidEvent(gpu=0, xid=13, source="kmsg", pid=i))
    assert len(wakes) == 1
    xids, events = src.drain()
    assert [e.pid for e in xids] == list(range(1000)) and events == []
    src.push(event=KernelEvent(kind="aer", source="kernel"))  # the first after a drain wakes again
    assert len(wakes) == 2 and len(src.drain()[1]) == 1


def test_pushes_racing_drains_leave_no_event_without_a_wake_after_it():
    """Four writers push while a reader drains only when woken (as the daemon's loop does) and
    stops once a wait sees no wake: every event was drained, so each had a wake after it."""
    src = KernelSource()
    woken = threading.Event()
    src.wake = woken.set
    got: list[int] = []
    done = threading.Event()

    def reader():  # drains when woken; stops at the first wait with no wake once the writers are done
        while True:
            if woken.wait(0.5):
                woken.clear()
                got.extend(e.pid for e in src.drain()[0])
            elif done.is_set():
                return

    def writer(base: int):
        for i in range(5000):
            src.push(XidEvent(gpu=0, xid=13, source="kmsg", pid=base + i))

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=writer, args=(k * 5000,)) for k in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    done.set()
    r.join(timeout=10)
    assert not r.is_alive()
    assert sorted(got) == list(range(20000))
