"""The predicted hand-over waits for nothing it does not need (issue #45 item 5, #44's xid79 gap).

Each test asserts an order or a bound that a wait would break (no wall-clock figure): the daemon
drains a node whose ranks committed their migrate snapshot before its next poll comes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Iterator

from conftest import register_agent, wait_for
from sentinel import config
from sentinel.channel import Ack, RankEndpoint
from sentinel.readings import XidEvent
from sentinel.sources import simulated

POLL_SECONDS = 3600.0  # no poll comes during a test: whatever happens, an event made it happen


def _daemon(tmp_path, stopped, spare_gate):
    """A daemon on simulated GPUs whose loop polls once an hour, a kernel source the test pushes
    Xids into, an agent-stop command that records the drain, and a spare command that answers
    only once the test writes a line into the FIFO ``spare_gate`` (a slow scheduler: its answer
    would wake the loop)."""
    from sentinel.builder import build_daemon
    from sentinel.sources.kernel import KernelSource

    class Pushed(KernelSource):
        name = "pushed"

        def start(self) -> None:
            self.up = {"pushed": True}

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    stop_cmd = json.dumps([sys.executable, "-c", f"open({str(stopped)!r}, 'w').write('stopped')"])
    spare_cmd = json.dumps(["sh", "-c", f"read line < '{spare_gate}'"])
    cfg = config.parse(f'[daemon]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                       f'poll_interval_seconds = {POLL_SECONDS}\n[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
                       f'[ebpf]\nenabled = false\nkmsg_fallback = false\n'
                       f'[actions]\nbackend = "command"\nack_timeout_seconds = 600.0\n'
                       f'command_timeout_seconds = 120.0\ncordon_command = ["true"]\n'
                       f'agent_stop_command = {stop_cmd}\nspare_command = {spare_cmd}\n')
    source = Pushed()
    return build_daemon(cfg, simulate=str(state), event_sources=[source]), source


def _release(gate) -> None:
    """The scheduler answers: the spare command reading the FIFO ends (nothing to do if it never started)."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return
    try:
        os.write(fd, b"go\n")
    finally:
        os.close(fd)


def _record(tmp_path) -> dict:
    try:
        return json.loads((tmp_path / "state" / "migration.json").read_text())
    except (OSError, ValueError):
        return {}


def _phase(tmp_path) -> str:
    return _record(tmp_path).get("phase", "")


@contextlib.contextmanager
def _running(tmp_path) -> Iterator[tuple]:
    """The daemon of :func:`_daemon` started with its loop running, this test process registered as
    the job's agent (its rank socket counts) and one rank endpoint open: (daemon, pushed source,
    rank, the agent-stopped marker). Stopped, closed and the slow scheduler released on any exit."""
    run = tmp_path / "run"
    register_agent(run)
    stopped = tmp_path / "agent-stopped"
    gate = tmp_path / "spare-gate"
    os.mkfifo(gate)
    daemon, source = _daemon(tmp_path, stopped, gate)
    rank = RankEndpoint.open(run)
    loop = threading.Thread(target=daemon.run, daemon=True)
    try:
        daemon.start()
        loop.start()
        yield daemon, source, rank, stopped
    finally:
        _release(gate)
        daemon.stop()
        loop.join(timeout=10)
        daemon.close()
        rank.close()


def _migrate_request(rank, what: str):
    requests: list = []
    wait_for(lambda: requests.extend(r for r in rank.poll() if r.type == "migrate") or requests, timeout=60, what=what)
    return requests[0]


def test_a_committed_migrate_snapshot_is_drained_without_waiting_for_a_poll(tmp_path):
    """Xid 79 arrives between polls (a kernel event), the rank commits its snapshot: the node is
    cordoned and its agent stopped while the next poll is still an hour away. Before, the daemon
    read acknowledgements only at its polls (1 s apart by default), and the drain waited for one."""
    with _running(tmp_path) as (daemon, source, rank, stopped):
        source.push(XidEvent(gpu=0, xid=79, source="kmsg"))
        req = _migrate_request(rank, "the migrate request (an event-driven trip)")
        assert _phase(tmp_path) == "requested" and not stopped.exists()  # nothing drains before the commit
        rank.ack(Ack(id=req.id, rank=0, step=41, ok=True, path="/snapshots/step-41", request_type="migrate"))
        wait_for(lambda: stopped.exists() and _phase(tmp_path) == "drained", timeout=60,
                 what="the drain after the committed ack, with no poll in between")
        record = _record(tmp_path)
        assert record["snapshot_step"] == 41 and record["snapshot_ok"] is True
        assert daemon.iterations == 1  # the loop's first poll, at its start: every step since came from an event
        assert "spare_called" not in record.get("times", {})  # the scheduler had not answered: no wake from it


def test_the_ack_watch_wakes_only_while_acknowledgements_are_due_and_ends_with_close():
    """A datagram on a rank's pair wakes the loop only while a request's acks are due (a rank
    writing to its own pair at other times costs the daemon nothing); close() ends the thread."""
    import socket

    from sentinel.ack_sockets import AckWatch

    def watchers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "sentinel-ack-watch"}

    others = watchers()
    asked, woken = [], []
    due = threading.Event()
    watch = AckWatch(lambda: woken.append(1), lambda fd: (asked.append(fd), due.is_set())[1])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        watch.add(ours)
        theirs.send(b"not due")
        wait_for(lambda: asked, timeout=30, what="the watch to see the first datagram")
        assert woken == []  # nothing due: no wake
        due.set()
        theirs.send(b"due")
        wait_for(lambda: woken, timeout=30, what="the wake for a due acknowledgement")
        watch.remove(ours)
    finally:
        watch.close()
        ours.close()
        theirs.close()
    assert watchers() <= others  # its thread is gone


def test_an_xid_from_nvmls_event_set_trips_without_waiting_for_a_poll(tmp_path):
    """Xid 79 reported through NVML's event set (the simulated GPUs here): the daemon decides on it
    while its next poll is an hour away. Before, the event thread queued it for the next poll."""
    with _running(tmp_path) as (daemon, _source, rank, _stopped):
        simulated.inject(tmp_path / "gpus.json", 0, ["xid=79"])
        req = _migrate_request(rank, "the migrate request from NVML's Xid event")
        assert "79" in req.reason and daemon.iterations == 1


def test_a_rank_writing_to_its_own_pair_while_it_owes_an_ack_wakes_the_loop_at_most_every_slow_gap():
    """Review of session 19 (F4): a rank that withholds its ack keeps its request open (up to
    retry_seconds) and could write to its own pair to wake the root daemon's loop ~100 times a
    second. Now a pair's first wakes of a round are immediate, then at most one per slow gap
    (deferred, not lost), and another rank's pair still wakes the loop: its ack is not held back."""
    import socket

    from sentinel.ack_sockets import AckWatch

    woken: list[float] = []
    flood_a, flood_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    good_a, good_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    flood_b.setblocking(False)
    owing = {flood_a.fileno(), good_a.fileno()}
    watch = AckWatch(lambda: woken.append(time.monotonic()), lambda fd: fd in owing)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                flood_b.send(b"x")
            except OSError:  # its queue is full (nobody reads it here): the edge comes when it drains
                pass
            time.sleep(0.001)

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        watch.add(flood_a)
        watch.add(good_a)
        start = time.monotonic()
        flooder.start()
        time.sleep(2.0)
        flood_woken = len(woken)
        span = time.monotonic() - start
        # bound: the free wakes, then one per slow gap (a pair's queue filling stops its edges: fewer)
        assert flood_woken <= AckWatch.FREE_WAKES + span / AckWatch.SLOW_GAP + 1, (flood_woken, span)
        assert watch.deferred > 0  # the flood's wakes were held back, not the whole stream taken
        before = len(woken)
        good_b.send(b"committed")  # another rank's ack, while the flood goes on
        wait_for(lambda: len(woken) > before, timeout=30, what="the other rank's wake during the flood")
        owing.discard(flood_a.fileno())  # its ack came in: its writes cost nothing any more
        time.sleep(0.3)
        settled = len(woken)
        time.sleep(1.0)
        assert len(woken) == settled
    finally:
        stop.set()
        flooder.join(5)
        watch.close()
        for sock in (flood_a, flood_b, good_a, good_b):
            sock.close()
