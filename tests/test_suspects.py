"""A dead node told from the job's own errors (#48): trainer/suspects.py, the probe pass of
trainer/slot_recovery.py, through real slot handlers on a real c10d TCPStore; the node that is
slowed or killed is a real process (SIGSTOP/SIGCONT, SIGKILL), with two CPU-bound processes
beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import REPO, wait_for
from trainer import suspects
from trainer.counting_store import CountingStore
from trainer.slot_recovery import Recovery
from trainer.slot_rendezvous import SlotRendezvousHandler, SlotTakenError

pytestmark = [pytest.mark.needs_torch]

GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:24491: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")


@dataclass
class Failure:  # torch's ProcessFailure as the agent sees it: the worker's own error message
    message: object


def test_evidence_is_a_connection_lost_by_a_peer_with_only_fixed_words_and_the_peer_address_kept():
    said = suspects.evidence_of({1: Failure("Signal 9 (SIGKILL) received by PID 7"),
                                 0: Failure({"message": GLOO_RESET, "extraInfo": {}})})
    assert said == "rank 0: connection reset by peer (peer 127.0.0.1:24491)"
    # the worker's own crash, a timeout, a signal: no evidence that a peer is gone
    for text in ("RuntimeError: CUDA error: an illegal memory access was encountered",
                 "DistBackendError: Socket Timeout", "Signal 6 (SIGABRT) received by PID 9", ""):
        assert suspects.evidence_of({0: Failure(text)}) == ""
    # the job's text never reaches the store: a line injected into the message is not carried
    evil = suspects.evidence_of({0: Failure("Broken pipe\n{\"id\": \"x\"} [::1]:99999 <script>")})
    assert evil == "rank 0: broken pipe"


class Taker:
    def __init__(self) -> None:
        self.got: list[str] = []

    def suspect(self, evidence: str) -> None:
        self.got.append(evidence)


def test_the_agent_hands_the_evidence_to_a_handler_that_takes_it_and_to_no_other():
    taker = Taker()
    assert suspects.report(taker, {0: Failure(GLOO_RESET)}).startswith("rank 0: connection reset by peer")
    assert suspects.report(taker, {0: Failure("ValueError: bad batch")}) == "" and len(taker.got) == 1
    assert suspects.report(object(), {0: Failure(GLOO_RESET)}) == ""  # torch's own handlers take none


SLEEPER = "import time; time.sleep(600)"


def test_a_probe_is_accepted_by_a_stopped_process_and_refused_once_it_is_gone():
    live = suspects.Liveness("127.0.0.1")
    address = live.address
    assert suspects.parse_address(address) == ("127.0.0.1", int(address.rsplit(":", 1)[1]))
    assert suspects.probe(address) == suspects.ALIVE and live.drain() == 1
    live.close()
    assert suspects.probe(address) == suspects.GONE
    for bad in ("", "no-port", "127.0.0.1:0", "127.0.0.1:70000", "a b:1", None, 7):
        assert suspects.probe(bad) == suspects.UNKNOWN
    # a loopback address is this host's own: probed only for a node that said it is on this host
    # (same boot and network namespace), else a refusal from the wrong host would declare it dead
    me = suspects.here()
    assert me and suspects.reachable_from_here(address, me, me)
    for loopback in (address, f"localhost:{address.rsplit(':', 1)[1]}", "[::1]:5"):
        assert not suspects.reachable_from_here(loopback, "another-host/1", me)
    assert suspects.reachable_from_here("198.18.0.12:5", "another-host/1", me)
    # a stopped process: its socket lives, the kernel accepts for it (slow is not gone)
    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8); "
            "print(s.getsockname()[1], flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        where = f"127.0.0.1:{int(proc.stdout.readline())}"
        proc.send_signal(signal.SIGSTOP)
        assert suspects.probe(where) == suspects.ALIVE
        proc.kill()
        proc.wait(10)
        assert suspects.probe(where) == suspects.GONE
    finally:
        proc.kill()
        proc.wait(10)


NODE = """
import sys, torch.distributed as dist
from datetime import timedelta
from trainer.slot_rendezvous import SlotRendezvousHandler, SlotTakenError
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=120))
h = SlotRendezvousHandler(store, "job", 3, local_addr="127.0.0.1", keep_alive_interval=1.0, admission_timeout=30.0,
                          join_timeout=120.0)
for line in sys.stdin:  # one round per line (SIGSTOPped and SIGCONTinued between them by the test)
    info = h.next_rendezvous()
    print("generation", h.gen, "rank", info.rank, flush=True)
"""
ROUNDS = 20


@pytest.fixture
def load():
    """Two CPU-bound processes beside the test (the acceptance's machine under load)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield burners
    for b in burners:
        b.kill()
        b.wait(10)


def rounds_in_threads(handlers: list[SlotRendezvousHandler]) -> tuple[list[threading.Thread], list]:
    out: list = [None] * len(handlers)

    def run(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    return threads, out


def joined(threads: list[threading.Thread], out: list) -> list:
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rendezvous did not return"
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def test_a_slow_node_under_load_is_never_evicted_by_the_survivors_evidence_and_a_killed_one_is(load):
    """20 rounds: the survivors arrive with evidence (their workers died of a reset connection)
    while the third node is SIGSTOPped, and one of them probes it until it was found alive at
    least twice; then it is continued and arrives. It keeps its slot every time, and no vacancy
    is posted (a warm spare waits throughout, probing too). Then it is SIGKILLed: the next round
    declares it from the probe (its keep-alive rule would need 30 s here) and the spare takes its
    slot and rank."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    node = subprocess.Popen([sys.executable, "-c", NODE, str(server.port)], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    conf = {"keep_alive_interval": 1.0, "admission_timeout": 30.0, "join_timeout": 120.0, "local_addr": "127.0.0.1"}
    hs = [SlotRendezvousHandler(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                              timeout=timedelta(seconds=120)), "job", 3, **conf) for _ in range(2)]
    spare = SlotRendezvousHandler(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                timeout=timedelta(seconds=120)), "job", 3, **conf)
    spare_box: list = []
    try:
        node.stdin.write("go\n")
        node.stdin.flush()
        infos = joined(*rounds_in_threads(hs))
        slot = int(node.stdout.readline().split()[3])
        assert sorted([slot, *(i.rank for i in infos)]) == [0, 1, 2]
        spare_thread = threading.Thread(target=lambda: spare_box.append(spare.next_rendezvous()), daemon=True)
        spare_thread.start()  # admitted: it waits for a vacancy, probing the slots that do not arrive
        for r in range(ROUNDS):
            node.send_signal(signal.SIGSTOP)
            for h in hs:
                h.suspect("rank 0: connection reset by peer (peer 127.0.0.1:1)")
            threads, out = rounds_in_threads(hs)
            def probed_alive() -> int:  # the stopped node's probes in this round that it answered
                return sum(a == (r + 2, slot, suspects.ALIVE) for h in [*hs, spare] for a in list(h.recovery.answers))

            wait_for(lambda: probed_alive() >= 2, 60, what=f"round {r}: the stopped node probed alive twice")
            node.send_signal(signal.SIGCONT)
            node.stdin.write("go\n")
            node.stdin.flush()
            assert [i.rank for i in joined(threads, out)] == [h.slot for h in hs]
            assert node.stdout.readline().split() == ["generation", str(r + 2), "rank", str(slot)]
            assert {h.gen for h in hs} == {r + 2}
        assert server.add("sentinel.rdzv.job/vacancies", 0) == 0 and not spare_box
        assert not any(h.recovery.declared for h in [*hs, spare])
        # the killed one: refused at once, declared from the probe, its slot and rank to the spare
        node.kill()
        node.wait(10)
        for h in hs:
            h.suspect("rank 0: connection reset by peer (peer 127.0.0.1:1)")
        infos = joined(*rounds_in_threads(hs))
        spare_thread.join(60)
        assert spare_box and spare_box[0].rank == slot and spare.slot == slot
        declared = [e for h in [*hs, spare] for e in h.recovery.declared]  # a survivor's probe, or the spare's
        assert [(e["slot"], e["how"], e["generation"]) for e in declared] == [(slot, "probe", ROUNDS + 2)]
        assert {h.gen for h in [*hs, spare]} == {ROUNDS + 2} and [i.rank for i in infos] == [h.slot for h in hs]
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGCONT)
            node.kill()
        node.wait(10)
        for h in [*hs, spare]:
            h.shutdown()


def test_a_node_declared_by_the_probe_is_fenced_like_any_declared_node():
    """The probe declares a node whose liveness socket refuses (here: closed while the handler
    object lives on, as a process that lost its socket would): its slot goes to the spare in the
    same generation, and its arrival and heartbeat of that generation are refused (#41's fence)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    conf = {"keep_alive_interval": 1.0, "admission_timeout": 30.0, "join_timeout": 60.0, "local_addr": "127.0.0.1"}

    def client() -> SlotRendezvousHandler:
        return SlotRendezvousHandler(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                   timeout=timedelta(seconds=60)), "job", 3, **conf)

    hs = [client() for _ in range(3)]
    spare = client()
    try:
        joined(*rounds_in_threads(hs))
        gone, live = hs[0], hs[1:]
        gone.liveness.close()
        for h in live:
            h.suspect("rank 0: broken pipe")
        infos = joined(*rounds_in_threads([*live, spare]))
        assert infos[2].rank == gone.slot and spare.slot == gone.slot and {h.gen for h in [*live, spare]} == {2}
        declared = [e for h in [*live, spare] for e in h.recovery.declared]
        assert [(e["slot"], e["how"], e["left"]) for e in declared] == [(gone.slot, "probe", gone.node_id)]
        assert gone.heartbeat() is False  # its generation (1) is not the job's any more
        with pytest.raises(SlotTakenError):
            gone.next_rendezvous()
    finally:
        for h in [*hs, spare]:
            h.shutdown()


def test_a_refusal_from_a_loopback_address_of_another_host_declares_nothing():
    """A node on another host that advertises a loopback address (a hostname mapped to 127.0.1.1)
    is never probed from here: its slot is left to keep-alive expiry."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    closed = suspects.Liveness("127.0.0.1")
    address = closed.address
    closed.close()  # refuses connects here
    posted: list = []
    store = CountingStore(server)
    store.set("r/g1/s0", json.dumps({"id": "far", "probe": address, "where": "another-host/1"}))
    store.set("r/g1/s1", json.dumps({"id": "near", "probe": address, "where": suspects.here()}))
    recovery = Recovery(store, server, lambda *p: "/".join(["r", *map(str, p)]), 2, 30.0,
                        lambda slot, f, mark: posted.append((slot, f, mark)), here=suspects.here())
    assert recovery.probe_pass(2, "rank 0: broken pipe") == 1
    assert [(slot, f, mark.split("#")[0]) for slot, f, mark in posted] == [(1, 2, "LEFT:near")]
    assert (2, 0, suspects.UNKNOWN) in recovery.answers and (2, 1, suspects.GONE) in recovery.answers


def test_a_queue_refilled_as_fast_as_it_is_drained_does_not_hold_the_heartbeat_back():
    """Any local user can connect to the liveness socket. The heartbeat thread drains the queue
    before each beat; a client that keeps the queue non-empty (here a socket whose queue never
    empties) must not keep the thread draining: a live node whose heartbeat stands still for one
    admission timeout is declared vacant. One drain takes at most one backlog's worth."""
    class Conn:
        def close(self) -> None:
            pass

    class Endless:  # a listening socket some client refills without end (empties after 10 backlogs: fail, not hang)
        def __init__(self) -> None:
            self.accepted = 0

        def accept(self):
            if self.accepted >= 10 * suspects.BACKLOG:
                raise BlockingIOError
            self.accepted += 1
            return Conn(), ("127.0.0.1", 1)

        def close(self) -> None:
            pass

    live = suspects.Liveness("127.0.0.1")
    live._tried, live._sock = True, Endless()
    assert 0 < live.drain() <= suspects.BACKLOG
