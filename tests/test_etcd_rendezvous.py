"""The slot rendezvous on a real 3-member etcd (Debian's etcd-server, TLS with the job's own CA,
client certificates required): the store's semantics, replacements, the leader killed, a member
frozen (cut off), a node that dies without a goodbye, and attacks by another local user and by a
process without the job's certificate. Every member is started here and killed at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from conftest import REPO, wait_for
from sentinel.etcd_pki import make_job_pki
from sentinel_tools.etcd_cluster import EtcdCluster
from trainer import etcd_rendezvous
from trainer.etcd_store import EtcdStore, EtcdStoreError, EtcdTLS
from trainer.slot_rendezvous import SlotRendezvousHandler

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]

FAST = {"keep_alive_interval": 1.0, "admission_timeout": 2.0, "join_timeout": 90.0}
OPEN: list[SlotRendezvousHandler] = []


@pytest.fixture
def cluster(tmp_path):
    pki = make_job_pki(tmp_path / "pki", "t", {"m0": [], "m1": [], "m2": []})
    c = EtcdCluster(tmp_path, ["m0", "m1", "m2"], pki=pki)
    c.start()
    try:
        yield c
    finally:
        while OPEN:
            h = OPEN.pop()
            h._stop_heartbeats()
        c.stop()


def handler(cluster, nodes: int, run_id: str = "job", **kw) -> SlotRendezvousHandler:
    store = cluster.store(lease_ttl=kw.get("admission_timeout", FAST["admission_timeout"]), failover_seconds=30.0)
    h = SlotRendezvousHandler(store, run_id, nodes, local_addr="127.0.0.1", backend="sentinel-etcd", **{**FAST, **kw})
    OPEN.append(h)
    return h


def rendezvous(handlers) -> list:
    out: list = [None] * len(handlers)

    def run(i):
        try:
            out[i] = handlers[i].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - returned to the test, which asserts on it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a rendezvous did not return"
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def first_join(cluster, nodes: int) -> list[SlotRendezvousHandler]:
    hs = [handler(cluster, nodes) for _ in range(nodes)]
    infos = rendezvous(hs)
    assert sorted(i.rank for i in infos) == list(range(nodes))
    return sorted(hs, key=lambda h: h.slot)


def test_store_semantics_match_c10d(cluster):
    s = cluster.store()
    assert s.compare_set("k", "", "a") == b"a"
    assert s.compare_set("k", "", "b") == b"a"  # taken: the current value comes back
    assert s.compare_set("k", "a", "c") == b"c"
    assert s.compare_set("missing", "x", "y") == b"x"  # c10d's answer for an absent key
    assert s.check(["k"]) and not s.check(["k", "missing"])
    with pytest.raises(EtcdStoreError, match="timeout"):
        s.wait(["never"], timedelta(seconds=0.5))
    threading.Timer(0.3, lambda: cluster.store().set("later", "v")).start()
    s.wait(["later"], timedelta(seconds=20))
    assert s.get("later") == b"v"
    # tickets from many connections at once are 1..N, each exactly once (no lost or double count)
    got: list[int] = []
    lock = threading.Lock()

    def take():
        mine = cluster.store()
        for _ in range(5):
            n = mine.add("tickets", 1)
            with lock:
                got.append(n)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == list(range(1, 31)) and s.add("tickets", 0) == 30


def test_a_write_from_an_older_generation_is_refused(cluster):
    s = cluster.store()
    s.set("latest", "3")
    assert s.fenced_set("latest", "3", "snap", "gen3")
    s.set("latest", "4")
    assert not s.fenced_set("latest", "3", "snap", "gen3-late")
    assert s.get("snap") == b"gen3"


def test_replacement_keeps_ranks_with_a_constant_number_of_requests(cluster):
    hs = first_join(cluster, 4)
    assert "left slot 2" in hs[2].leave()
    spare = handler(cluster, 4)
    survivors = [hs[0], hs[1], hs[3]]
    infos = rendezvous([*survivors, spare])
    assert [i.rank for i in infos] == [0, 1, 3, 2]
    assert {h.gen for h in [*survivors, spare]} == {2}
    # the agents' store is the generation's workers' TCPStore: every agent reaches it
    infos[1].store.set("probe", "1")
    assert infos[0].store.get("probe") == b"1"
    assert all(h.last_round["ops"] <= 10 for h in survivors), [h.last_round for h in survivors]


def test_the_leader_killed_between_rounds_and_during_one_loses_nothing(cluster):
    hs = first_join(cluster, 3)
    leader = cluster.leader()
    cluster.stop_member(leader)  # its host powered off: SIGKILL, no goodbye
    hs[1].leave()
    spare = handler(cluster, 3)
    infos = rendezvous([hs[0], hs[2], spare])
    assert [i.rank for i in infos] == [0, 2, 1] and {hs[0].gen, hs[2].gen, spare.gen} == {2}
    # again, with the new leader killed while the round runs (two of three are needed: restart one)
    cluster.start_member(leader)
    spare.leave()
    spare2 = handler(cluster, 3)
    second = cluster.leader()
    threading.Timer(0.2, cluster.stop_member, args=(second,)).start()
    infos = rendezvous([hs[0], hs[2], spare2])
    assert [i.rank for i in infos] == [0, 2, 1] and {hs[0].gen, hs[2].gen, spare2.gen} == {3}


def test_a_frozen_member_never_splits_the_job(cluster):
    """A member cut off (SIGSTOP: it answers nobody) while two spares race for one vacancy:
    exactly one gets the slot, every slot has one owner in the new generation."""
    hs = first_join(cluster, 3)
    victim = next(n for n in cluster.members if n != cluster.leader())
    hs[1].leave()
    cluster.members[victim].proc.send_signal(signal.SIGSTOP)
    spares, threads = [], []
    try:
        spares += [handler(cluster, 3) for _ in range(2)]
        done: list = []
        ended: list = []

        def spare_round(s):
            try:
                done.append(s.next_rendezvous())
            except RendezvousClosedError as exc:  # the losing spare, once the test closes the rendezvous
                ended.append(exc)

        threads += [threading.Thread(target=spare_round, args=(s,), daemon=True) for s in spares]
        for t in threads:
            t.start()
        infos = rendezvous([hs[0], hs[2]])
        wait_for(lambda: len(done) == 1, 60, what="one spare admitted")
        owners = sorted([hs[0].slot, hs[2].slot, *(s.slot for s in spares if s.slot is not None)])
        assert owners == [0, 1, 2] and [i.rank for i in infos] == [0, 2]
        assert sum(s.gen == 2 for s in spares) == 1
    finally:
        cluster.members[victim].proc.send_signal(signal.SIGCONT)
        if spares:
            spares[0].set_closed()
        for t in threads:
            t.join(60)
    assert len(ended) == 1 and not any(t.is_alive() for t in threads)


DYING_NODE = """
import sys
from trainer.etcd_store import EtcdStore, EtcdTLS
from trainer.slot_rendezvous import SlotRendezvousHandler
eps = [(h, int(p)) for h, p in (e.split(":") for e in sys.argv[1].split(","))]
store = EtcdStore(eps, tls=EtcdTLS(*sys.argv[2:5]), lease_ttl=2)
# no liveness socket: like a host that powered off, it answers no probe (#48), so its lease decides
h = SlotRendezvousHandler(store, "job", 3, local_addr="127.0.0.1", keep_alive_interval=1.0, admission_timeout=2.0,
                          join_timeout=90.0, liveness=False)
print("joined", h.next_rendezvous().rank, h.node_id, flush=True)
sys.stdin.readline()
"""


def test_a_node_that_dies_without_a_goodbye_expires_and_is_replaced(cluster):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pki = cluster.pki
    node = subprocess.Popen([sys.executable, "-c", DYING_NODE, cluster.endpoint(), str(pki.cacert),
                             str(pki.client_cert), str(pki.client_key)], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hs = [handler(cluster, 3), handler(cluster, 3)]
        infos = rendezvous(hs)
        _, rank, node_id = node.stdout.readline().split()
        rank = int(rank)
        assert sorted([rank, *(i.rank for i in infos)]) == [0, 1, 2]
        store = cluster.store()
        hb = f"sentinel.rdzv.job/hb/{rank}"
        wait_for(lambda: store.beat_owner(hb) == node_id, 60, what="the node's first heartbeat")
        node.kill()  # the host is gone: no leave, its heartbeat's lease runs out
        node.wait(10)
        wait_for(lambda: not store.check([hb]), 30, what="the dead node's heartbeat lease expired")
        spare = handler(cluster, 3)
        infos = rendezvous([*hs, spare])
        assert infos[2].rank == rank and [i.rank for i in infos[:2]] == [h.slot for h in hs]
        # declared vacant on the evidence of its expired lease (the vacancy names it), not after
        # the passes a slot that never beat gets ("LEFT:unknown")
        vacancy = json.loads(store.get("sentinel.rdzv.job/vacancy/1"))
        left, _, nonce = vacancy.pop("left").partition("#")  # the declaration's own nonce after '#'
        assert vacancy == {"slot": rank, "gen": 2} and left == f"LEFT:{node_id}" and len(nonce) == 8
        assert [e["how"] for h in [*hs, spare] for e in h.recovery.declared] == ["keep-alive"]
    finally:
        node.kill()
        node.wait(10)


def test_an_election_that_holds_back_a_live_nodes_heartbeat_evicts_nobody_alive(cluster):
    """The etcd leader's host goes silent (SIGSTOP: its member answers nobody, as on a powered-off
    host) while a node dies without a goodbye and a spare watches the forming generation. The live
    survivor's heartbeat connection was on that member: no write of it lands until it fails over,
    and etcd takes none at all until a new leader is elected. Only the dead node's slot is declared
    vacant; the live one keeps its slot and the round commits with every live node (issue #42: a
    CI run declared the live survivor vacant here and stalled the job)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pki = cluster.pki
    leader = cluster.leader()
    node = subprocess.Popen([sys.executable, "-c", DYING_NODE, cluster.endpoint(), str(pki.cacert),
                             str(pki.client_cert), str(pki.client_key)], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    frozen = cluster.members[leader].proc
    try:
        # the survivor talks to the leader's member first, with etcd_rendezvous's request_timeout=6
        first = [(m.address, m.client_port) for n, m in cluster.members.items() if n == leader]
        store = EtcdStore(first + [e for e in cluster.endpoints() if e not in first], lease_ttl=2,
                          tls=EtcdTLS(str(pki.cacert), str(pki.client_cert), str(pki.client_key)),
                          failover_seconds=30.0, request_seconds=6.0)
        live = SlotRendezvousHandler(store, "job", 3, local_addr="127.0.0.1", backend="sentinel-etcd", **FAST)
        OPEN.append(live)
        other = handler(cluster, 3)
        rendezvous([live, other])
        _, rank, node_id = node.stdout.readline().split()
        watcher = cluster.store()
        hb = "sentinel.rdzv.job/hb/{}"
        wait_for(lambda: watcher.beat_owner(hb.format(rank)) == node_id, 60, what="the node's first heartbeat")
        spare = handler(cluster, 3)
        admitted: list = []
        waiting = threading.Thread(target=lambda: admitted.append(spare.next_rendezvous()), daemon=True)
        waiting.start()
        node.kill()  # no goodbye
        node.wait(10)
        frozen.send_signal(signal.SIGSTOP)
        wait_for(lambda: spare.recovery.declared, 60, what="the dead node's slot declared vacant")
        # the live survivor's heartbeat moves again (read through the members that answer)
        reader = EtcdStore([e for e in cluster.endpoints() if e not in first], lease_ttl=2,
                           tls=EtcdTLS(str(pki.cacert), str(pki.client_cert), str(pki.client_key)))
        beats = [reader.get(hb.format(live.slot))]
        for _ in range(2):
            wait_for(lambda: reader.check([hb.format(live.slot)]) and reader.get(hb.format(live.slot)) != beats[-1],
                     30, what="the live survivor's heartbeat after the election")
            beats.append(reader.get(hb.format(live.slot)))
        assert [e["slot"] for e in spare.recovery.declared] == [int(rank)], spare.recovery.declared
        infos = rendezvous([live, other])
        waiting.join(60)
        assert [i.rank for i in infos] == [live.slot, other.slot] and admitted and admitted[0].rank == int(rank)
        assert {live.gen, other.gen, spare.gen} == {2}
    finally:
        frozen.send_signal(signal.SIGCONT)
        node.kill()
        node.wait(10)


def test_registry_builds_the_etcd_handler_and_refuses_a_range(cluster):
    etcd_rendezvous.register()
    pki = cluster.pki
    conf = {"cacert": str(pki.cacert), "cert": str(pki.client_cert), "key": str(pki.client_key)}
    params = RendezvousParameters("sentinel-etcd", cluster.endpoint(), "job", 2, 2, **conf)
    h = get_rendezvous_handler(params)
    assert isinstance(h, SlotRendezvousHandler) and h.get_backend() == "sentinel-etcd"
    assert not h.is_closed()
    with pytest.raises(ValueError, match="fixed size"):
        get_rendezvous_handler(RendezvousParameters("sentinel-etcd", cluster.endpoint(), "job", 1, 2, **conf))
    with pytest.raises(ValueError, match="cacert"):
        get_rendezvous_handler(RendezvousParameters("sentinel-etcd", cluster.endpoint(), "job", 2, 2,
                                                    cert=conf["cert"], key=conf["key"]))


def attack(attacker, cluster, *curl_tls: str) -> list[str]:
    """As ``attacker``, with curl (a real HTTP client): read the job's ``latest`` and write it."""
    out = []
    for m in cluster.members.values():
        base = f"https://{m.address}:{m.client_port}/v3/kv"
        for path, body in (("range", '{"key": "%s"}'), ("put", '{"key": "%s", "value": "OTk5"}')):
            r = attacker.run(["curl", "-sS", "--max-time", "5", *curl_tls, "-d", body % LATEST_B64, f"{base}/{path}"])
            out.append(f"{path} rc={r.returncode} {r.stdout.strip()[:120]} {r.stderr.strip()[:120]}")
    return out


LATEST_B64 = __import__("base64").b64encode(b"sentinel.rdzv.job/latest").decode()


def test_another_user_and_a_process_without_the_certificate_cannot_touch_the_rendezvous(cluster, attacker, shared_tmp):
    """Run for real as an unprivileged local user: the job's key is 0600 (another user cannot read
    it), and without it — no certificate, or one from a CA of the attacker's own — every member
    refuses the TLS handshake: no key of the job's rendezvous is read or written."""
    hs = first_join(cluster, 2)
    store = cluster.store()
    before = store.get("sentinel.rdzv.job/latest")
    pki = cluster.pki
    assert oct(os.stat(pki.client_key).st_mode & 0o777) == "0o600"
    os.chmod(pki.dir, 0o755)  # even with the directory open, the key itself stays unreadable
    stolen = attacker.run(["cat", str(pki.client_key)])
    assert stolen.returncode != 0 and "Permission denied" in stolen.stderr
    own = make_job_pki(shared_tmp / "attacker", "evil", {"x": []}, uid=attacker.uid, gid=attacker.gid)
    os.chmod(shared_tmp / "attacker", 0o755)
    ca = shared_tmp / "ca.pem"  # the job's CA certificate is public: give it to the attacker
    ca.write_bytes(pki.cacert.read_bytes())
    os.chmod(ca, 0o644)
    tries = {
        "with the job's files": attack(attacker, cluster, "--cacert", str(ca), "--cert", str(pki.client_cert),
                                       "--key", str(pki.client_key)),
        "no certificate": attack(attacker, cluster, "--cacert", str(ca)),
        "a certificate of its own CA": attack(attacker, cluster, "--cacert", str(ca), "--cert", str(own.client_cert),
                                              "--key", str(own.client_key)),
        "not checking the members": attack(attacker, cluster, "-k"),
    }
    for how, lines in tries.items():
        assert all(" rc=0 " not in line for line in lines), (how, lines)  # curl never got an answer
    assert store.get("sentinel.rdzv.job/latest") == before
    # plain HTTP to a TLS member: not a request etcd serves
    m = next(iter(cluster.members.values()))
    r = attacker.run(["curl", "-sS", "--max-time", "5", "-d", '{"key": "%s"}' % LATEST_B64,
                      f"http://{m.address}:{m.client_port}/v3/kv/range"])
    assert "kvs" not in r.stdout
    assert [h.slot for h in hs] == [0, 1]


def test_a_process_of_the_job_user_without_the_certificate_is_refused(cluster, tmp_path):
    """Same uid (root here), no certificate: the handshake is refused, so a stray process on the
    host that reaches the port cannot join, read or rewrite the rendezvous. Nor can another job
    of the same user on the same hosts: each job has its own CA (``sentinel launch`` makes one per
    job, :mod:`sentinel.etcd_pki`), so job B's agent — its own certificate, with its own CA or
    with job A's to check A's members — is refused by job A's members before any key."""
    first_join(cluster, 2)
    before = cluster.store().get("sentinel.rdzv.job/latest")
    job_b = make_job_pki(tmp_path / "job-b", "job-b", {"b0": ["127.0.0.1"]})
    clients = {
        "no certificate": EtcdTLS(str(cluster.pki.cacert)),
        "job B's certificate and CA": EtcdTLS(str(job_b.cacert), str(job_b.client_cert), str(job_b.client_key)),
        "job B's certificate, job A's CA": EtcdTLS(str(cluster.pki.cacert), str(job_b.client_cert),
                                                  str(job_b.client_key)),
    }
    for how, tls in clients.items():
        other = EtcdStore(cluster.endpoints(), tls=tls, failover_seconds=0.5)
        for op in (lambda: other.get("sentinel.rdzv.job/latest"), lambda: other.set("sentinel.rdzv.job/closed", "1"),
                   lambda: other.set("sentinel.rdzv.job/latest", "999")):
            with pytest.raises(EtcdStoreError):
                op()
    assert not cluster.store().check(["sentinel.rdzv.job/closed"])
    assert cluster.store().get("sentinel.rdzv.job/latest") == before


def test_the_daemon_shows_the_members_the_leader_and_who_it_cannot_reach(cluster, start_daemon, sim_state, tmp_path):
    """`sentinel status` and /metrics: every member reachable and one leader; the leader's host
    lost: its member unreachable, another one leading (the daemon's own view, over TLS)."""
    from conftest import metric_value

    pki = cluster.pki
    endpoints = ", ".join(f'"{a}:{p}"' for a, p in cluster.endpoints())
    cfg = tmp_path / "sentinel.toml"
    cfg.write_text(f"[job]\nrendezvous_etcd_endpoints = [{endpoints}]\nrendezvous_etcd_cacert = \"{pki.cacert}\"\n"
                   f"rendezvous_etcd_cert = \"{pki.client_cert}\"\nrendezvous_etcd_key = \"{pki.client_key}\"\n"
                   "rendezvous_check_seconds = 1\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg))

    def store():
        return d.status.get("rendezvous_store") or {}

    wait_for(lambda: store().get("leader"), 60, what="the daemon's view of the etcd leader")
    leader = store()["leader"]
    assert leader == cluster.leader() and all(m["reachable"] for m in store()["members"]), store()
    text = d.scrape()
    assert metric_value(text, "sentinel_rendezvous_store_member_leader", member=leader) == 1
    assert all(metric_value(text, "sentinel_rendezvous_store_member_up", member=n) == 1 for n in cluster.members)
    cluster.stop_member(leader)
    wait_for(lambda: store().get("leader") not in (None, leader), 60, what="a new leader in the daemon's view")
    gone = next(m for m in store()["members"] if m["name"] == leader)
    assert not gone["reachable"] and not gone["leader"]
    out = subprocess.run([sys.executable, "-m", "sentinel", "status", "--runtime-dir", str(d.runtime_dir)],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert f"leader {store()['leader']}" in out.stdout and "UNREACHABLE" in out.stdout, out.stdout
    wait_for(lambda: metric_value(d.scrape(), "sentinel_rendezvous_store_member_up", member=leader) == 0, 30,
             what="the lost member's up gauge at 0")
