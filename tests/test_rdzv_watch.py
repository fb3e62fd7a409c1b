"""#47 item 4: torch's dynamic rendezvous (c10d) converges when its participants are alive however
slowly they run, and a stalled round says who it waits for (trainer/rdzv_watch.py). Real agents'
rendezvous handlers (trainer.elastic's wiring) on a real c10d store; starvation is SIGSTOP."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from test_elastic import store  # noqa: F401 - the TCPStore fixture (a trainer.store process, removed also on failure)

pytestmark = [pytest.mark.needs_torch]
pytest.importorskip("torch")

# One agent's rendezvous: trainer.elastic's handler wiring, then one next_rendezvous.
JOIN = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry
from trainer.elastic import Rendezvous
port, run_id = sys.argv[1], sys.argv[2]
params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=3, max_nodes=3,
                              is_host="false", read_timeout="60", keep_alive_interval="1", keep_alive_max_attempt="3",
                              join_timeout="600")
rdzv = Rendezvous(registry.get_rendezvous_handler(params), 0.1)
if len(sys.argv) > 3:  # a gate: the join loop's polls wait for the test (a starved join loop; the counter thread runs)
    import time
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    gate, delay = sys.argv[3], dr._delay
    def gated(seconds):
        if seconds == 1 and not os.path.exists(gate):
            open(gate + ".waiting", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.05)
        delay(seconds)
    dr._delay = gated
print("joining", flush=True)
info = rdzv.handler.next_rendezvous()
print(json.dumps({"rank": info.rank, "world": info.world_size, "round": rdzv.handler._state_holder.state.round}),
      flush=True)
hold = os.environ.get("HOLD_UNTIL")  # stay a live participant (keep-alives beating) until the test says
while hold and not os.path.exists(hold):
    import time
    time.sleep(0.1)
os._exit(0)  # as trainer.elastic.exit_now: no interpreter teardown under the keep-alive threads' store calls
"""

# Each agent runs WINDOW_S in turn, all stopped otherwise: one cycle is 3 x PERIOD_S, so when an
# agent runs, the one before it last ran PERIOD_S - WINDOW_S ago and the one before that
# 2 x PERIOD_S - WINDOW_S ago: older than torch's eviction window (keep_alive 1 s x 3 attempts).
WINDOW_S = 1.0
PERIOD_S = 3.0
CONVERGE_S = 90.0  # 10 cycles; on 0cd5d80 no round completes in them (each join evicts a live node)



def test_starved_agents_converge_in_one_round_and_a_stalled_round_names_who_it_waits_for(tmp_path, store):
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    hold = tmp_path / "all-out"  # an agent that came out stays alive: every eviction would be of a live node
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOLD_UNTIL": str(hold)}
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]
    procs: list[subprocess.Popen] = []

    def start(i: int) -> None:
        with open(logs[i], "w") as out:
            procs.append(subprocess.Popen([sys.executable, str(script), str(store), "job47"], cwd=REPO, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))

    def text(i: int) -> str:
        return logs[i].read_text()

    def out(i: int) -> bool:
        return any(x.startswith("{") for x in text(i).splitlines())

    try:
        # 1. Two of three join, the third is not there: each says, in one line, that the round of
        #    3 has 2 (both named, with their keep-alives) instead of waiting silently
        start(0)
        start(1)
        line = wait_for(lambda: next((x for x in text(0).splitlines() if "rendezvous stalled:" in x), None), 120,
                        what="agent 0's stall report")
        assert "round" in line and "in the round 2 of 3 needed" in line, line
        assert line.count("keep-alive") == 2 and "(this node)" in line, line  # both named, with their keep-alives
        # 2. The third joins, and from then on each agent runs 1 s in turn, stopped otherwise (a
        #    host so loaded that every agent's keep-alive is older than the window when the next
        #    one looks): all three are alive, so the round must complete with the three of them
        for p in procs:
            if p.poll() is None:  # (a started agent never ends before the round completes)
                os.kill(p.pid, signal.SIGSTOP)
        start(2)  # it joins while the other two are stopped (their keep-alives lapse meanwhile)
        wait_for(lambda: "joining" in text(2), 120, what="agent 2 to start joining")
        if procs[2].poll() is None:
            os.kill(procs[2].pid, signal.SIGSTOP)
        end = time.monotonic() + CONVERGE_S
        turn = 0
        while time.monotonic() < end and not all(out(i) for i in range(3)):
            p = procs[turn % 3]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                time.sleep(WINDOW_S)
                os.kill(p.pid, signal.SIGSTOP)
            time.sleep(PERIOD_S - WINDOW_S)
            turn += 1
        # every agent is stopped here: the logs read below are complete (resumed, an agent that came
        # out could rightly evict one whose turn was > the window ago, after the round: not asserted)
        done = [out(i) for i in range(3)]
        assert all(done), (f"no round completed in {CONVERGE_S:.0f} s of starved but live agents:\n"
                           + "\n".join(text(i)[-1500:] for i in range(3)))
        results = [json.loads(next(x for x in text(i).splitlines() if x.startswith("{"))) for i in range(3)]
        assert sorted(r["rank"] for r in results) == [0, 1, 2] and {r["world"] for r in results} == {3}, results
        assert len({r["round"] for r in results}) == 1, results  # one round, the same for all
        assert not any("evicting" in text(i) for i in range(3)), [text(i)[-1500:] for i in range(3)]
    finally:
        hold.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL ends a stopped process as it is (resumed, it would sync once more)
            p.wait(timeout=60)


def _committed(port: int, run_id: str):
    """The rendezvous state as the store holds it (what every agent's next sync reads)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    backend = C10dRendezvousBackend(client, run_id)

    def read():
        got = backend.get_state()
        return pickle.loads(got[0]) if got is not None else None

    return read


def test_a_participant_that_learns_of_its_round_after_evictions_gets_the_world_the_round_completed_with(tmp_path, store):
    """One round of 3 completes with A, B and C (one compare-and-set: complete, ranks 0-2). A and C
    return and exit; B's join loop has not synced since it joined (its keep-alive counter thread
    runs: a starved loop). A fourth agent D, there for the next round, evicts the gone A and C
    from the complete round (their keep-alives and counters stood still) and commits that. Then B
    syncs: it must come out with the world its round completed with, 3, as A and C did, not with
    the participants left (torch's ``_get_world``: ``len(state.participants)``, 1 here; in CI
    the same left an agent with world 2 beside two with world 3). Fails on dabd21c: B's world 1."""
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    gate = tmp_path / "gate"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    logs = {n: tmp_path / f"{n}.log" for n in "ABCD"}
    procs: dict[str, subprocess.Popen] = {}
    run_id = "job47split"

    def start(name: str, *extra: str) -> None:
        with open(logs[name], "w") as out:
            procs[name] = subprocess.Popen([sys.executable, str(script), str(store), run_id, *extra], cwd=REPO,
                                           env=env, stdout=out, stderr=subprocess.STDOUT)

    def result(name: str) -> dict | None:
        line = next((x for x in logs[name].read_text().splitlines() if x.startswith("{")), None)
        return json.loads(line) if line else None

    state = _committed(store, run_id)

    def pids(s) -> set[int]:
        return {n.pid for n in s.participants} if s is not None else set()

    try:
        start("A")
        start("B", str(gate))
        wait_for(lambda: pids(state()) == {procs["A"].pid, procs["B"].pid}, 120, 0.2, what="A and B in the round")
        wait_for(lambda: Path(str(gate) + ".waiting").exists(), 60, what="B's join loop to wait at the gate")
        start("C")
        wait_for(lambda: result("A") and result("C"), 120, 0.2, what="A and C to come out of the round")
        done = state()
        assert done.complete and pids(done) == {procs[n].pid for n in "ABC"}, vars(done)
        wait_for(lambda: procs["A"].poll() is not None and procs["C"].poll() is not None, 60, what="A and C to exit")
        start("D")
        wait_for(lambda: (lambda s: s.complete and pids(s) == {procs["B"].pid})(state()), 120, 0.2,
                 what="D to evict the gone A and C from the complete round")
        gate.touch()
        wait_for(lambda: result("B"), 60, 0.2, what="B to come out of the round")
        results = {n: result(n) for n in "ABC"}
        assert {r["world"] for r in results.values()} == {3}, results  # one round, one world
        assert sorted(r["rank"] for r in results.values()) == [0, 1, 2], results
        assert len({r["round"] for r in results.values()}) == 1, results
    finally:
        gate.touch()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)


def test_a_drill_that_does_not_finish_prints_each_agent_s_last_stall_line(tmp_path):
    from types import SimpleNamespace

    from sentinel_tools.drill_report import rendezvous_stalls

    nodes = []
    for name, lines in (("node0", ["[sentinel.elastic] x WARNING rendezvous stalled: job round 3 first",
                                   "other", "[sentinel.elastic] y WARNING rendezvous stalled: job round 4 second"]),
                        ("spare0", ["nothing stalled here"]), ("spare1", None)):
        root = tmp_path / name
        root.mkdir()
        if lines is not None:
            (root / "agent.log").write_text("\n".join(lines) + "\n")
        nodes.append(SimpleNamespace(name=name, root=root))
    assert rendezvous_stalls(SimpleNamespace(nodes=nodes)) == ["node0's agent: rendezvous stalled: job round 4 second"]


class _Counters:
    """The others' keep-alive counters as the store holds them, and this node's own beats."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.beats = 0

    def counter(self, node: str) -> int:
        return self.values.get(node, 0)


def test_a_late_node_is_evicted_only_when_its_counter_stood_still_over_this_node_s_own_beats():
    """The sanitizer's rule (no store, no torch): keep-alives in the state lapsed for both nodes;
    the live one's counter moves, the dead one's does not; nothing is evicted while this node's own
    counter thread is starved too (its beats do not advance), the dead one once it beat twice."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from trainer.rdzv_watch import Sanitizer, describe_dynamic

    old = datetime.now(timezone.utc) - timedelta(seconds=10)
    state = SimpleNamespace(round=4, complete=False, closed=False, participants={"me": 0, "slow": 0, "dead": 0},
                            wait_list=set(), redundancy_list=set(),
                            last_heartbeats={"me": datetime.now(timezone.utc), "slow": old, "dead": old})
    settings = SimpleNamespace(keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3, run_id="job",
                               min_nodes=3, max_nodes=3)
    holder = SimpleNamespace(_state=state, _dead_nodes=[])
    live = _Counters()
    epilogues = []
    clock = [0.0]
    sanitize = Sanitizer(holder, settings, live, lambda st, se: epilogues.append(st.round), clock=lambda: clock[0])

    def sync(slow_beats: int, own_beats: int) -> None:
        live.values["'slow'"] = live.values.get("'slow'", 0) + slow_beats
        live.beats += own_beats
        clock[0] += 1.0
        sanitize()

    sync(1, 0)  # first seen late: watched from here
    for _ in range(5):
        sync(0, 0)  # this node starved as well: no judgement
    assert set(state.participants) == {"me", "slow", "dead"}
    sync(1, 1)
    sync(0, 1)  # the dead one: still over 2 of our beats; the slow one moved 1 beat ago
    assert set(state.participants) == {"me", "slow"} and holder._dead_nodes == ["dead"] and epilogues == [4]
    assert "dead" not in state.last_heartbeats and sanitize.evicted == {"'dead'": 1}
    line = describe_dynamic(state, settings, "me", sanitize, 42.0, {"'slow'": 3})
    assert line.startswith("rendezvous stalled: job round 4 not complete after 42 s"), line
    assert "in the round 2 of 3 needed" in line and "lapsed, counter 3" in line and "'dead' x1" in line, line


def test_a_node_paused_for_less_than_the_window_is_not_evicted_though_this_node_beat_twice_meanwhile():
    """SIGSTOP turns: this node runs ~1 s and beats on resume and 1 s later while the other one is
    paused; the other's counter stood still over two of this node's beats but only ~1 s by this
    node's clock: kept. Still after window - interval (2 s) by the clock: evicted."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from trainer.rdzv_watch import Sanitizer

    state = SimpleNamespace(round=0, complete=False, closed=False, participants={"me": 0, "other": 0},
                            wait_list=set(), redundancy_list=set(),
                            last_heartbeats={"me": datetime.now(timezone.utc),
                                             "other": datetime.now(timezone.utc) - timedelta(seconds=5)})
    settings = SimpleNamespace(keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3)
    holder = SimpleNamespace(_state=state, _dead_nodes=[])
    live = _Counters()
    clock = [100.0]
    sanitize = Sanitizer(holder, settings, live, lambda st, se: None, clock=lambda: clock[0])
    sanitize()  # first seen overdue
    for _ in range(2):
        live.beats += 1
        clock[0] += 0.55
        sanitize()
    assert set(state.participants) == {"me", "other"} and holder._dead_nodes == []  # 2 beats in 1.1 s: kept
    clock[0] += 0.9
    sanitize()
    assert set(state.participants) == {"me"} and holder._dead_nodes == ["other"]


def test_a_complete_round_keeps_the_world_it_was_marked_complete_with_whatever_is_evicted_after():
    """torch's state and its executor's own ``_mark_rendezvous_complete`` (wrapped as the watch
    wraps it): the recorded world outlives an eviction from the complete round by the sanitizer;
    a record from an earlier round is not used for the next one."""
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from trainer.rdzv_watch import Sanitizer, record_world, world_of

    settings = SimpleNamespace(keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3, run_id="job",
                               min_nodes=3, max_nodes=3)
    state = dr._RendezvousState()
    now = datetime.now(timezone.utc)
    for node in ("a", "b", "c"):
        state.participants[node] = 0
        state.last_heartbeats[node] = now - timedelta(seconds=10 if node == "c" else 0)
    executor = SimpleNamespace(_state=state)
    executor._mark_rendezvous_complete = lambda: dr._DistributedRendezvousOpExecutor._mark_rendezvous_complete(executor)
    executor._node, executor._settings, executor._record = "a", settings, lambda *a, **k: None
    record_world(executor)()
    assert state.complete and world_of(state, "b") == (1, 3)
    holder = SimpleNamespace(_state=state, _dead_nodes=[])
    live = _Counters()
    clock = [0.0]
    sanitize = Sanitizer(holder, settings, live, dr._remove_participant_epilogue, clock=lambda: clock[0])
    sanitize()
    live.beats += 2
    clock[0] += 2.0
    sanitize()  # "c": its keep-alive and counter stood still over two of this node's beats and 2 s
    assert set(state.participants) == {"a", "b"} and state.complete
    assert world_of(state, "b") == (1, 3) and world_of(state, "a") == (0, 3)  # not (1, 2): the round had 3
    state.round += 1  # a later round completed by an agent without the watch: torch's answer
    assert world_of(state, "b") == (1, 2)


def test_a_world_another_store_writer_recorded_is_used_only_when_the_round_can_have_it():
    """The recorded world comes back from the c10d store (torch's pickled state), which any user
    who reaches the store can write: a world that is no whole number, below the participants left
    or this rank + 1, or above max_nodes, is not used (torch's count instead) and never raises.
    On 72494aa ``(round, "x")`` raised ValueError in ``_get_world`` and ``(round, 10**6)`` or
    ``(round, 1)`` with two ranks were returned as the world."""
    import pickle

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from trainer.rdzv_watch import WORLD, world_of

    def read_back(recorded):
        state = dr._RendezvousState()
        state.round, state.complete = 4, True
        state.participants.update({"a": 0, "b": 1})
        setattr(state, WORLD, recorded)
        return pickle.loads(pickle.dumps(state))  # as _BackendRendezvousStateHolder reads it

    for forged in [(4, "x"), (4, 10**6), (4, 1), (4, True), (4, -3), (4, 2.5), (4, None), ("4", 3), [4, 3], (4,)]:
        assert world_of(read_back(forged), "b", max_nodes=3) == (1, 2), forged
    assert world_of(read_back((4, 3)), "b", max_nodes=3) == (1, 3)  # a round of 3 that lost one: kept
    assert world_of(read_back((3, 3)), "b", max_nodes=3) == (1, 2)  # an earlier round's: torch's count


def test_a_stalled_slot_generation_names_the_slots_it_waits_for_and_how_long_their_heartbeats_stood_still():
    from trainer.rdzv_watch import describe_slots

    class Store:  # the calls describe_slots makes, on the slot protocol's keys
        def __init__(self, keys: dict[str, bytes]) -> None:
            self.keys = keys

        def check(self, keys: list[str]) -> bool:
            return all(k in self.keys for k in keys)

        def get(self, key: str) -> bytes:
            return self.keys[key]

        def add(self, key: str, n: int) -> int:
            return int(self.keys.get(key, b"0"))

    p = "sentinel.rdzv.job"
    store = Store({f"{p}/latest": b"3", f"{p}/g4/s1": b'{"id": "spare0:1"}', f"{p}/g4/s2": b"LEFT:node2:7",
                   f"{p}/hb/0": b"node0:41", f"{p}/spares": b"2", f"{p}/vacancies": b"1"})
    seen: dict = {}
    describe_slots(store, p, 3, 0, 5.0, seen, now=100.0)
    line = describe_slots(store, p, 3, 0, 17.0, seen, now=112.5)
    assert line.startswith("rendezvous stalled: generation 4 (committed: 3) not committed after 17 s"), line
    assert "arrived 1 of 3: slot 1 (spare0:1)" in line and "vacant, for a spare: slot 2" in line, line
    assert "waiting for: slot 0 (heartbeat unchanged for 12.5 s)" in line and "spare tickets 2, vacancies posted 1" in line


def test_names_another_user_plants_in_the_store_reach_the_stall_line_escaped_and_bounded(caplog):
    """On a TCPStore anyone who reaches the port writes the slot protocol's keys. ``nobody`` plants
    arrival records whose ids carry a terminal escape, a line break that forges a second
    ``rendezvous stalled:`` line (the drill's report prints each agent's last one) and 100 kB; a
    record that is not an object; then a ``latest`` that is not a number. The line stays one line
    of printable ASCII, a few hundred characters; an unreadable state says so, bounded too."""
    from datetime import timedelta

    import torch.distributed as dist

    from store_intruder import plant
    from trainer.rdzv_watch import describe_slots, stall_reports

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    p = "sentinel.rdzv.job"
    forged = "\x1b]0;owned\x07\x1b[2J\nrendezvous stalled: forged by nobody " + "A" * 100_000
    plant(server.port, {f"{p}/latest": b"1", f"{p}/g2/s0": json.dumps({"id": forged}).encode(),
                        f"{p}/g2/s1": b"[1, 2]", f"{p}/g2/s2": b"\xff\xfe not json"})
    line = describe_slots(server, p, 4, 0, 5.0, {}, now=100.0)
    assert line.isascii() and line.isprintable() and len(line) < 1000, line[:2000]
    assert "arrived 3 of 4: slot 0 (\\x1b]0;owned\\x07\\x1b[2J\\nrendezvous stalled: forged" in line, line
    assert "slot 1 (?), slot 2 (?)" in line and "waiting for: slot 3 (no heartbeat)" in line, line

    plant(server.port, {f"{p}/latest": b"\x1b[2J" + b"9" * 100_000})
    caplog.set_level("WARNING", logger="sentinel.elastic")
    with stall_reports(lambda waited: describe_slots(server, p, 4, 0, waited, {}, now=100.0), 0.05):
        wait_for(lambda: any("state unreadable" in r.getMessage() for r in caplog.records), 30, what="the stall line")
    said = next(r.getMessage() for r in caplog.records if "state unreadable" in r.getMessage())
    assert said.isascii() and said.isprintable() and len(said) < 1000, said[:2000]
