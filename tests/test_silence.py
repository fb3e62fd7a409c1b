"""A host that answers nothing, told by the waiting spare's probes (#41): trainer/silence.py and
the silence pass of trainer/slot_recovery.py. The hosts are real sockets: an agent that answers
(a SIGSTOPped process, beside two CPU-bound ones: the kernel completes the handshake for it), and
one that answers nothing (a listener whose accept queue is full: the kernel drops every SYN, as
for a host whose power went). The end-to-end case, a namespaced host powered off with its link,
is tests/test_netns_hosts.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import signal
import time
from datetime import timedelta

import pytest
from conftest import SYSTEM_PYTHON

from trainer import silence, suspects
from trainer.counting_store import CountingStore
from trainer.slot_recovery import Recovery


class Mute:
    """A unit stand-in for a host that answers nothing, on 127.0.0.1: a "liveness socket" and a
    "kernel-answer port" that are both listeners with a full accept queue (backlog 0), so neither
    answers a connect. (A real kernel-answer port always answers: a real host that answers
    nothing, powered off on its own network namespace, is in test_a_powered_off_host_...; a real
    agent whose queue a local user fills is in test_a_local_user_filling_...) ``speak`` empties
    both queues: both answer, as a reachable host's do."""

    def __init__(self, muted: bool = True) -> None:
        self.sock, self.kernel_sock = socket.socket(), socket.socket()
        for s in (self.sock, self.kernel_sock):
            s.bind(("127.0.0.1", 0))
            s.listen(0)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.kernel = f"127.0.0.1:{self.kernel_sock.getsockname()[1]}"
        self.pair = (self.address, self.kernel)
        self.fill: list[socket.socket] = []
        if muted:
            self.mute()

    def mute(self) -> None:
        for s in (self.sock, self.kernel_sock):
            for _ in range(2):
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(s.getsockname())
                self.fill.append(c)
        time.sleep(0.05)

    def speak(self) -> None:
        """Empty the queues: connects are answered again (until they fill)."""
        for s in (self.sock, self.kernel_sock):
            if s.fileno() == -1:
                continue
            s.setblocking(False)
            while True:
                try:
                    s.accept()[0].close()
                except BlockingIOError:
                    break
        for c in self.fill:
            c.close()
        self.fill = []

    def close(self) -> None:
        self.speak()
        self.sock.close()
        self.kernel_sock.close()


def pair(live: suspects.Liveness) -> tuple[str, str]:
    return live.address, live.kernel_address


def greet(watch: silence.SilenceWatch, targets: dict, *mutes: Mute, live=None) -> None:
    """The watcher hears each target's kernel-answer port once (a silence needs that proof of the
    path), then the mutes fall silent."""
    for m in mutes:
        m.speak()
    for _ in range(5):
        assert watch.step(targets, lambda s: b"1") == []
        for m in mutes:
            m.speak()
        if live is not None:
            live.drain()
        time.sleep(0.05)
    for m in mutes:
        m.mute()


@pytest.fixture
def stopped_agent():
    """A listening process, SIGSTOPped (its kernel still answers for it), beside two CPU burners."""
    code = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1024); "
            "k = socket.socket(); k.bind(('127.0.0.1', 0)); "
            "print(s.getsockname()[1], k.getsockname()[1], flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        port, kernel = proc.stdout.readline().split()
        proc.send_signal(signal.SIGSTOP)
        yield (f"127.0.0.1:{int(port)}", f"127.0.0.1:{int(kernel)}")
    finally:
        for p in [proc, *burners]:
            p.kill()
            p.wait(10)


def watch_for(watch: silence.SilenceWatch, targets: dict[int, str], seconds: float, beat=lambda slot: b"1",
              between=lambda: None) -> tuple[list, float]:
    """Passes every interval for ``seconds``: (the first pass's silent slots that were not empty, when)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        silent = watch.step(targets, beat)
        if silent:
            return silent, time.monotonic() - start
        between()
        time.sleep(watch.interval)
    return [], time.monotonic() - start


def test_a_host_that_answers_nothing_is_silent_after_its_window_and_a_stopped_one_never(stopped_agent):
    mute = Mute()
    watch = silence.SilenceWatch(window=1.0, interval=0.1)
    targets = {0: stopped_agent, 1: mute.pair}
    try:
        greet(watch, targets, mute)
        silent, after = watch_for(watch, targets, 10.0)
        assert [(slot, address) for slot, address, _ in silent] == [(1, mute.address)]
        assert after >= 1.0  # never before its window (its probes were unanswered all along)
        # the stopped agent was asked as often, and answered every time (the kernel did)
        for _ in range(10):
            assert all(slot == 1 for slot, _, _ in watch.step(targets, lambda s: b"1"))
            time.sleep(0.1)
    finally:
        watch.close()
        mute.close()


def test_a_silent_slot_whose_heartbeat_moves_or_a_prober_that_hears_nobody_declares_nothing():
    live, mute, other = suspects.Liveness("127.0.0.1"), Mute(), Mute()
    beats = iter(range(10**6))
    try:
        # the heartbeat moves (the host reaches the store: it is our path to it that is broken)
        watch = silence.SilenceWatch(window=0.5, interval=0.1)
        greet(watch, {0: pair(live), 1: mute.pair}, mute, live=live)
        silent, _ = watch_for(watch, {0: pair(live), 1: mute.pair}, 2.0,
                              beat=lambda slot: str(next(beats)).encode(), between=live.drain)
        assert silent == []
        watch.close()
        # every slot silent: the prober may be the one cut off
        watch = silence.SilenceWatch(window=0.5, interval=0.1)
        greet(watch, {0: mute.pair, 1: other.pair}, mute, other)
        silent, _ = watch_for(watch, {0: mute.pair, 1: other.pair}, 2.0)
        assert silent == []
        watch.close()
    finally:
        live.close()
        mute.close()
        other.close()


def test_a_cut_shorter_than_the_window_evicts_nobody():
    live, mute = suspects.Liveness("127.0.0.1"), Mute()
    watch = silence.SilenceWatch(window=1.0, interval=0.1)
    targets = {0: pair(live), 1: mute.pair}
    try:
        greet(watch, targets, mute, live=live)
        silent, _ = watch_for(watch, targets, 0.6, between=live.drain)
        assert silent == []
        mute.speak()  # the link is back: the next probe is answered, the count starts again
        silent, _ = watch_for(watch, targets, 2.0, between=lambda: (live.drain(), mute.speak()))
        assert silent == []
    finally:
        watch.close()
        live.close()
        mute.close()


def test_a_slow_round_trip_widens_the_slots_window():
    """A host whose handshakes took 0.5 s (a saturated, shaped link: the kernel's own measure,
    here injected) gets max(window, 4 x 0.5 s): its silence must last 2 s, not 1 s."""
    live, target = suspects.Liveness("127.0.0.1"), Mute(muted=False)
    port = target.sock.getsockname()[1]
    watch = silence.SilenceWatch(window=1.0, interval=0.1,
                                 rtt=lambda sock: 0.5 if sock.getpeername()[1] == port else 0.0001)
    targets = {0: pair(live), 1: target.pair}
    try:
        for _ in range(3):  # answered, each after 0.5 s
            assert watch.step(targets, lambda s: b"1") == []
            live.drain(), target.speak()
            time.sleep(0.1)
        target.mute()
        silent, after = watch_for(watch, targets, 6.0, between=live.drain)
        assert [slot for slot, _, _ in silent] == [1] and silent[0][2] == 2.0
        assert after >= 2.0
    finally:
        watch.close()
        live.close()
        target.close()


def test_the_silence_pass_declares_the_silent_slot_once_and_names_the_rule():
    """Through the recovery on a real TCPStore: the committed generation's arrival records name
    each agent's liveness socket; the silent one's slot is vacant in the next generation, with
    ``how`` = "silence" and the vacancy posted; a slot that arrived is never declared."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    live, mute = suspects.Liveness("127.0.0.1"), Mute(muted=False)
    store = CountingStore(server)
    for slot, (name, (address, kernel)) in enumerate([("a", pair(live)), ("b", mute.pair), ("c", mute.pair)]):
        store.set(f"r/g1/s{slot}", json.dumps({"id": name, "probe": address, "kernel": kernel, "where": suspects.here()}))
        store.set(f"r/hb/{slot}", f"{name}:1")
    store.set("r/g2/s2", json.dumps({"id": "c"}))  # c arrived in generation 2: not vacant whatever its probe says
    posted: list = []
    recovery = Recovery(store, server, lambda *p: "/".join(["r", *map(str, p)]), 3, 30.0,
                        lambda slot, f, mark: posted.append((slot, f, mark)), here=suspects.here())
    watch = silence.SilenceWatch(window=0.5, interval=0.1)
    try:
        for _ in range(5):  # the prober hears each kernel-answer port, then b's host falls silent
            assert recovery.silence_pass(2, watch) == 0
            live.drain(), mute.speak()
            time.sleep(0.05)
        mute.mute()
        start = time.monotonic()
        while time.monotonic() - start < 5.0 and not posted:
            recovery.silence_pass(2, watch)
            live.drain()
            time.sleep(0.1)
        for _ in range(3):  # still silent: declared once only
            recovery.silence_pass(2, watch)
        assert [(slot, f, mark.split("#")[0]) for slot, f, mark in posted] == [(1, 2, "LEFT:b")]
        assert [(e["slot"], e["how"]) for e in recovery.declared] == [(1, "silence")]
        assert recovery.declared[0]["evidence"].startswith(f"no answer from {mute.address}")
    finally:
        watch.close()
        live.close()
        mute.close()


def slot_clients(keep_alive_interval: float):
    """A TCPStore server on 127.0.0.1 and a maker of slot handlers of one 2-node job on it (0.5 s
    silence window)."""
    import torch.distributed as dist

    from trainer.slot_rendezvous import SlotRendezvousHandler

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    conf = {"keep_alive_interval": keep_alive_interval, "admission_timeout": 30.0, "join_timeout": 60.0,
            "local_addr": "127.0.0.1", "silence_window": 0.5}

    def client() -> SlotRendezvousHandler:
        return SlotRendezvousHandler(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                   timeout=timedelta(seconds=60)), "job", 2, **conf)

    return server, client


def test_a_warm_spare_declares_a_silent_node_before_its_admission_and_takes_its_slot_once_admitted():
    """Through real slot handlers on a real TCPStore: a 2-node job, one node's agent answers no
    probe (its liveness socket's queue full: a host whose power went). A warm spare's passes while
    it waits for its admission (``watch_silence``, as trainer.elastic calls them) declare that
    slot by silence; admitted, the spare takes it in the same generation as the survivor."""
    import threading

    from trainer.slot_rendezvous import SlotRendezvousHandler

    server, client = slot_clients(keep_alive_interval=1.0)

    mute = Mute(muted=False)
    live, dead, spare = client(), client(), client()
    mute.sock.setblocking(False)  # as a liveness socket is (its heartbeat thread drains it, never waits on it)
    # its arrival record names the mute sockets
    dead.liveness._tried, dead.liveness._sock, dead.liveness._kernel = True, mute.sock, mute.kernel_sock
    out: dict = {}

    def join(name: str, h: SlotRendezvousHandler) -> None:
        out[name] = h.next_rendezvous()

    try:
        threads = [threading.Thread(target=join, args=(n, h), daemon=True) for n, h in (("live", live), ("dead", dead))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for _ in range(5):  # the spare hears every host (its kernel-answer port) while it waits
            time.sleep(spare.watch_silence())
            mute.speak()
        assert spare.recovery.declared == []
        dead._stop_heartbeats()  # the host is gone: no beat, no drain of its queue either
        time.sleep(0.2)
        mute.mute()  # whatever its last drain took
        start = time.monotonic()
        while time.monotonic() - start < 10 and not spare.recovery.declared:
            time.sleep(spare.watch_silence())
        assert [(e["slot"], e["how"], e["generation"]) for e in spare.recovery.declared] == [(dead.slot, "silence", 2)]
        threads = [threading.Thread(target=join, args=(n, h), daemon=True) for n, h in (("live2", live), ("spare", spare))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out["spare"].rank == dead.slot and out["live2"].rank == live.slot and spare.gen == live.gen == 2
    finally:
        for h in (live, dead, spare):
            h.shutdown()
        mute.close()


FLOOD = """
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
host, port = sys.argv[1].rsplit(":", 1)
held, said = [], False
while True:  # connects that complete wait in the accept queue; keep it full whatever is drained
    c = socket.socket()
    c.setblocking(False)
    c.connect_ex((host.strip("[]"), int(port)))
    held.append(c)
    if len(held) >= 1500 and not said:
        print("full", flush=True)
        said = True
    if len(held) >= 15000:
        for c in held[:5000]:
            c.close()
        del held[:5000]
    time.sleep(0.0005 if said else 0)
"""


def flood_as_nobody(address: str) -> subprocess.Popen:
    """An unprivileged local user (``nobody``) filling the accept queue of the liveness socket
    at ``address`` and keeping it full; returns once >= 1,500 connects were made."""
    # the system interpreter: the test runner's may live under /root (0700). setpriv execs it (runuser
    # would fork it and its kill would leave the flooder running, as it did until session 18)
    proc = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", SYSTEM_PYTHON, "-c",
                             FLOOD, address],
                            stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout.readline().strip() == "full"
    return proc


def test_a_local_user_filling_a_live_agents_liveness_queue_does_not_get_its_host_declared_vacant():
    """The attack of the session-17 security review, through real slot handlers: ``nobody``
    fills the live victim's liveness accept queue (the kernel then drops the spare's SYNs: its
    probes go unanswered while the other agent answers, and the heartbeat beats every 5 s).
    The victim's kernel-answer port still refuses every probe: the waiting spare declares
    nothing, and the probe pass never calls it gone."""
    import threading

    server, client = slot_clients(keep_alive_interval=5.0)

    live, victim, spare = client(), client(), client()
    flooder = None
    try:
        threads = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in (live, victim)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert live.gen == victim.gen == 1
        for _ in range(5):
            time.sleep(spare.watch_silence())
        flooder = flood_as_nobody(victim.liveness.address)
        assert suspects.probe(victim.liveness.address, 0.3) == suspects.UNKNOWN  # the queue is full: no answer
        start = time.monotonic()
        while time.monotonic() - start < 8 * 0.5:  # 8 windows
            time.sleep(spare.watch_silence())
        assert spare.recovery.declared == []
        assert spare.recovery.probe_pass(2, "test", probe=lambda a: suspects.probe(a, 0.1)) == 0
        assert flooder.poll() is None  # the flood held all along
    finally:
        if flooder is not None:
            flooder.kill()
            flooder.wait(10)
        for h in (live, victim, spare):
            h.shutdown()


AGENT = """
import sys, time
from trainer import suspects
live = suspects.Liveness(sys.argv[1])
print(live.address, live.kernel_address, flush=True)
time.sleep(600)
"""


@pytest.fixture
def far_host():
    """A real host on its own network namespace (sentinel_tools.netns), reached from this test's
    namespace over its bridge (a /30 of its own on the bridge and on the host), running an
    agent's liveness socket and kernel-answer port. Everything removed whatever happened."""
    import secrets
    from pathlib import Path

    from sentinel_tools import netns

    if netns.missing():
        pytest.skip(netns.missing())
    c = netns.NetnsCluster(["far"])
    agent = None
    try:
        c.start()
        host, net = c.hosts["far"], f"198.19.{secrets.randbelow(250)}.{4 * secrets.randbelow(60)}"
        mine, theirs = net.rsplit(".", 1)[0] + f".{int(net.rsplit('.', 1)[1]) + 1}", \
            net.rsplit(".", 1)[0] + f".{int(net.rsplit('.', 1)[1]) + 2}"
        subprocess.run(["ip", "addr", "add", f"{mine}/30", "dev", c.bridge], check=True)
        subprocess.run(["ip", "-n", host.netns, "addr", "add", f"{theirs}/30", "dev", "eth0"], check=True)
        repo = str(Path(__file__).resolve().parents[1])
        agent = subprocess.Popen(host.wrap(["env", f"PYTHONPATH={repo}", sys.executable, "-c", AGENT, theirs]),
                                 stdout=subprocess.PIPE, text=True)
        address, kernel = agent.stdout.readline().split()
        yield c, host, (address, kernel)
    finally:
        if agent is not None:
            agent.kill()
            agent.wait(10)
        assert c.teardown() == []
        assert netns.leftovers(c.prefix) == {"netns": [], "links": [], "processes": []}


def test_a_powered_off_host_is_silent_and_its_flooded_queue_under_abort_on_overflow_is_neither_silent_nor_gone(far_host):
    """The real stand-in of a dead host: a namespaced host whose link goes down and whose
    processes are killed (``power_off``: no FIN, no RST leaves it). Before that, the same host
    alive with ``net.ipv4.tcp_abort_on_overflow=1`` (its namespace's own) and ``nobody`` keeping
    its agent's liveness queue full (the kernel then drops SYNs and resets handshakes it cannot
    queue): the waiting spare's silence pass declares nothing, the probe pass never reads "gone"
    (a reset after the handshake is not a refusal of the connect). Powered off: declared by
    silence, not before its window."""
    import torch.distributed as dist

    c, host, (address, kernel) = far_host
    subprocess.run(host.wrap(["sysctl", "-qw", "net.ipv4.tcp_abort_on_overflow=1"]), check=True)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    live = suspects.Liveness("127.0.0.1")
    store = CountingStore(server)
    for slot, (name, (probe, k)) in enumerate([("near", pair(live)), ("far", (address, kernel))]):
        store.set(f"r/g1/s{slot}", json.dumps({"id": name, "probe": probe, "kernel": k, "where": suspects.here()}))
        store.set(f"r/hb/{slot}", f"{name}:1")
    recovery = Recovery(store, server, lambda *p: "/".join(["r", *map(str, p)]), 2, 30.0,
                        lambda slot, f, mark: None, here=suspects.here())
    watch = silence.SilenceWatch(window=0.5, interval=0.1)
    flooder = None

    def passes(seconds: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < seconds and not recovery.declared:
            recovery.silence_pass(2, watch)
            live.drain()
            time.sleep(0.1)
        return time.monotonic() - start

    try:
        passes(0.5)
        assert recovery.declared == [] and watch._slots[(1, (address, kernel))].kernel_answered
        flooder = flood_as_nobody(address)
        answers = [suspects.probe(address, 0.2) for _ in range(20)]
        assert suspects.GONE not in answers and suspects.UNKNOWN in answers  # the flood holds; never "gone"
        passes(8 * 0.5)
        assert recovery.declared == []
        assert recovery.probe_pass(2, "test", probe=lambda a: suspects.probe(a, 0.1)) == 0
        assert flooder.poll() is None
        flooder.kill()
        flooder.wait(10)
        flooder = None
        c.power_off("far", silent=True)
        after = passes(10.0)
        assert [(e["slot"], e["how"]) for e in recovery.declared] == [(1, "silence")]
        assert after >= 0.5
    finally:
        if flooder is not None:
            flooder.kill()
            flooder.wait(10)
        watch.close()
        live.close()


def test_a_probe_the_spare_could_not_open_is_no_unanswered_probe(monkeypatch):
    """The spare at its own descriptor limit (EMFILE, or ENOBUFS: its process, not the host it
    probes): a probe whose sockets could not be opened was never sent, so it is not a probe that
    went unanswered. Slot 1 (an agent on ::1) answers, then the spare cannot open any IPv6 socket
    (a stand-in for a process whose free descriptors slot 0's probes take first, pass after pass)
    while slot 0 keeps answering: slot 1 must not be declared silent. On 72494aa it was, after
    its window (its probes stayed pending with no socket behind them)."""
    live4, live6 = suspects.Liveness("127.0.0.1"), suspects.Liveness("::1")
    real = socket.socket
    starved = {"on": False}

    def opening(family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and starved["on"] and family == socket.AF_INET6:
            raise OSError(24, "Too many open files")
        return real(family, type, proto, fileno)

    targets = {0: pair(live4), 1: pair(live6)}
    watch = silence.SilenceWatch(window=0.5, interval=0.1)
    try:
        assert live6.address.startswith("[::1]:")
        greet(watch, targets, live=live4)
        live6.drain()
        monkeypatch.setattr(socket, "socket", opening)
        starved["on"] = True
        silent, _ = watch_for(watch, targets, 2.0, between=lambda: (live4.drain(), live6.drain()))
        assert silent == []
    finally:
        monkeypatch.undo()
        watch.close()
        live4.close()
        live6.close()


def test_many_silent_slots_hold_no_more_probe_sockets_than_the_cap_and_a_live_one_is_never_declared():
    """Forty slots whose records point at addresses that answer nothing (a rack powered off, or
    records another store writer forged): each unanswered probe stays open its window, 2 x window
    / interval sockets a slot (720 here without a cap, measured on 72494aa; a 1,024-descriptor
    process runs out at about 57 such slots, its store connections with it). The watch keeps at
    most ``max_inflight`` open; the live slot among them is never declared; every silent one still is (each
    slot's turn to start first comes round)."""
    live, mutes = suspects.Liveness("127.0.0.1"), [Mute(muted=False) for _ in range(40)]
    targets = {0: pair(live), **{s + 1: m.pair for s, m in enumerate(mutes)}}
    watch = silence.SilenceWatch(window=0.5, interval=0.1, max_inflight=60)
    try:
        greet(watch, targets, *mutes, live=live)
        declared: set[int] = set()
        start, peak = time.monotonic(), 0
        while time.monotonic() - start < 20.0 and declared != set(range(1, 41)):  # (4 s at load 1)
            declared |= {slot for slot, _, _ in watch.step(targets, lambda s: b"1")}
            peak = max(peak, sum(len(st.inflight) for st in watch._slots.values()))
            live.drain()
            time.sleep(watch.interval)
        assert peak <= 60 and declared == set(range(1, 41)), (peak, sorted(declared))
    finally:
        watch.close()
        live.close()
        for m in mutes:
            m.close()
