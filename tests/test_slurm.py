"""The Slurm backend against a real slurmctld + 4 slurmd on loopback (tests/slurm_cluster.py):
drain with Sentinel's reason, resume only Sentinel's drain, an admin's drain left alone, the
node name checked at start, a refusal naming the privilege, an unreachable controller retried
off the loop, and the circuit breaker counting the partition's Sentinel drains."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, metric_value, register_agent, wait_for
from sentinel.backends import make_backend
from sentinel.backends.base import BackendContext, CordonReason, PermissionDenied, Unreachable, UnknownNode
from sentinel.channel import RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig, SlurmConfig
from sentinel.migration import Migrator
from sentinel.policy import Trip

pytestmark = pytest.mark.needs_slurm
REASON = CordonReason("xid", 0, "Xid 79 on GPU 0", "req1")


@pytest.fixture
def clean(slurm):
    yield slurm
    slurm.reset_nodes()


def backend(slurm, tmp_path, node, run=subprocess.run, **slurm_keys):
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    actions = ActionsConfig(backend="slurm", command_timeout_seconds=5.0, slurm=SlurmConfig(**slurm_keys))
    return make_backend(actions, BackendContext(node=node, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                                                timeout=5.0, wall=time.time, run=run, env=slurm.env))


def sentinel_cli(slurm, *args, timeout=60):
    env = {**slurm.env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "sentinel", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO))


def test_drain_shows_sentinels_reason_and_uncordon_resumes_it(clean, tmp_path):
    b = backend(clean, tmp_path, "node2")
    b.check()
    b.cordon(REASON)
    reasons = clean.run("sinfo", "-R", "-h", "-N", "-o", "%N|%E").stdout
    assert "node2|sentinel: xid gpu0 Xid 79 on GPU 0" in reasons
    assert clean.node("node2")["State"].startswith("IDLE+DRAIN")
    state = b.is_cordoned()
    assert state.cordoned and state.by_sentinel
    assert (tmp_path / "state" / "cordon.json").exists()  # the local marker: sentinel launch refuses
    # a new job avoids it
    r = clean.run("srun", "-N3", "--immediate=10", "bash", "-c", "echo $SLURMD_NODENAME", timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.split()) == ["node1", "node3", "node4"]
    said = b.uncordon()
    assert "node2 resumed" in said and "cordon cleared" in said
    assert not clean.node("node2")["State"].count("DRAIN")
    assert not b.is_cordoned().cordoned


def test_an_admins_drain_is_never_overwritten_nor_resumed(clean, tmp_path):
    assert clean.run("scontrol", "update", "nodename=node4", "state=drain", "reason=admin: bad fan").returncode == 0
    b = backend(clean, tmp_path, "node4")
    b.cordon(REASON)
    assert clean.node("node4")["Reason"] == "admin: bad fan"  # not replaced by Sentinel's
    assert any("already drained by someone else" in n for n in b.take_notes())
    assert not b.is_cordoned().by_sentinel
    r = sentinel_cli(clean, "uncordon", "--config", str(write_config(tmp_path, "node4")))
    assert r.returncode == 0, r.stderr
    assert "drained by someone else ('admin: bad fan'); left alone" in r.stdout
    assert "DRAIN" in clean.node("node4")["State"] and clean.node("node4")["Reason"] == "admin: bad fan"


def write_config(tmp_path, node, **actions) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in actions.items())
    path = tmp_path / f"{node}.toml"
    run = tmp_path / f"run-{node}"
    state = tmp_path / f"state-{node}"
    path.write_text(f'[daemon]\nnode_name = "{node}"\nruntime_dir = "{run}"\nstate_dir = "{state}"\npoll_interval_seconds = 0.2\n'
                    f'[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
                    f'[actions]\nbackend = "slurm"\ncommand_timeout_seconds = 5.0\n{extra}'
                    '[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    return path


def test_an_unknown_node_name_stops_the_daemon_at_start(slurm, tmp_path, sim_state):
    r = sentinel_cli(slurm, "run", "--config", str(write_config(tmp_path, "gpu-node-17")), "--simulate", str(sim_state),
                     "--no-ebpf", timeout=60)
    assert r.returncode == 2
    assert "node 'gpu-node-17' is not known to Slurm" in r.stderr and "daemon.node_name" in r.stderr
    with pytest.raises(UnknownNode):
        backend(slurm, tmp_path, "gpu-node-17").check()


def test_an_unprivileged_daemon_is_told_which_privilege_it_lacks(clean, tmp_path, attacker):
    def as_attacker(argv, **kw):
        kw["env"] = {**kw.get("env", {}), "PATH": "/usr/bin:/bin"}
        kw.setdefault("timeout", 10)
        return subprocess.run(argv, user=attacker.uid, group=attacker.gid, extra_groups=[], **kw)

    b = backend(clean, tmp_path, "node3", run=as_attacker)
    b.check()  # reading is allowed to everyone
    with pytest.raises(PermissionDenied) as exc:
        b.cordon_scheduler(REASON)
    assert "AdminLevel of Operator" in str(exc.value) and "state=drain" in str(exc.value)
    assert "DRAIN" not in clean.node("node3")["State"]


def slow_scontrol(tmp_path) -> Path:
    """A controller that never answers: the call hangs until the backend's timeout kills it."""
    path = tmp_path / "scontrol-hung"
    path.write_text("#!/bin/sh\nexec sleep 60\n")
    path.chmod(0o755)
    return path


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_hung_controller_is_retried_off_the_loop_and_exported(slurm, tmp_path):
    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    (tmp_path / "state").mkdir()
    # each call hangs HUNG s (x 2 attempts); a tick that waited for one would take that long
    HUNG = 2.0
    actions = ActionsConfig(backend="slurm", ack_timeout_seconds=0.1, command_timeout_seconds=HUNG, scheduler_attempts=2,
                            scheduler_backoff_seconds=0.1, slurm=SlurmConfig(scontrol=str(slow_scontrol(tmp_path))))
    slept = []
    m = Migrator(actions, ep, state_dir=tmp_path / "state", runtime_dir=run_dir, node="node2",
                 signal_agent=lambda rec, sig: None, sleep=lambda s: (slept.append(s), time.sleep(s)),
                 workers=concurrent.futures.ThreadPoolExecutor(2))
    m.backend.ctx.env = slurm.env
    try:
        trip = Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79 on GPU 0", values={})
        m.begin("r1", trip)
        worst = 0.0
        end = time.monotonic() + 30
        while time.monotonic() < end and m.record.phase != "drained":
            t0 = time.monotonic()
            m.tick([])
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        assert m.record.phase == "drained"
        # the loop never waited for a hung call (the bound that matters, not a tick's speed: a tick
        # took 0.36 s on a host running two suites)
        assert worst < HUNG
        calls = m.metric_counters()
        # (a later retry may already be running: at least the cordon step's two attempts)
        assert calls[("sentinel_backend_calls", (("backend", "slurm"), ("op", "cordon"), ("outcome", "retried")))] >= 1
        assert calls[("sentinel_backend_calls", (("backend", "slurm"), ("op", "cordon"), ("outcome", "failed")))] >= 1
        assert m.gauges()[("sentinel_backend_up", (("backend", "slurm"),))] == 0.0
        assert slept and slept[0] == 0.1
        assert m.record.scheduler_cordoned is False
        assert any("slurm cordon failed" in n and f"did not finish within {HUNG:g} s" in n for n in m.record.notes)
        assert (tmp_path / "state" / "cordon.json").exists()  # the local cordon still holds
    finally:
        m.close()
        ep.close()


def test_unreachable_controller_is_unreachable_not_unknown(slurm, tmp_path):
    dead = tmp_path / "dead.conf"
    dead.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}", "SlurmctldPort=1")
                    .replace("MessageTimeout=10", "MessageTimeout=2"))
    b = backend(slurm, tmp_path, "node2")
    b.ctx.env = {**slurm.env, "SLURM_CONF": str(dead)}
    t0 = time.monotonic()
    with pytest.raises(Unreachable):
        b.check()
    assert time.monotonic() - t0 < 15


def test_with_slurmctld_down_the_snapshot_request_leaves_before_any_scheduler_call(slurm, tmp_path):
    """The real scontrol against a controller that is not there: the migrate request reaches the
    rank before any scheduler call began (events recorded in this process, in order), and the
    migration still ends drained locally, the scheduler's cordon left for later retries."""
    dead = tmp_path / "dead.conf"
    dead.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}", "SlurmctldPort=1")
                    .replace("MessageTimeout=10", "MessageTimeout=2"))
    events: list[tuple[str, str]] = []

    def run(argv, **kw):
        events.append(("call", argv[0]))
        try:
            return subprocess.run(argv, **kw)
        finally:
            events.append(("returned", argv[0]))

    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    rank = RankEndpoint.open(run_dir)
    send = ep.request
    ep.request = lambda kind, *a, **kw: (send(kind, *a, **kw), events.append(("request", kind)))[0]
    (tmp_path / "state").mkdir()
    m = Migrator(ActionsConfig(backend="slurm", command_timeout_seconds=5.0, ack_timeout_seconds=0.5,
                               scheduler_attempts=1), ep, state_dir=tmp_path / "state", runtime_dir=run_dir, node="node2",
                 run=run, signal_agent=lambda rec, sig: None, workers=concurrent.futures.ThreadPoolExecutor(2))
    m.backend.ctx.env = {**slurm.env, "SLURM_CONF": str(dead)}
    try:
        m.begin("r1", Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79 on GPU 0", values={}))
        assert [(r.type, r.id) for r in rank.poll()] == [("migrate", "r1")]
        first_call = next((i for i, e in enumerate(events) if e[0] == "call"), len(events))
        assert ("request", "migrate") in events[:first_call]
        wait_for(lambda: (m.tick([]), m.record.phase)[1] == "drained", timeout=60, what="drained")
        assert m.record.scheduler_cordoned is False and (tmp_path / "state" / "cordon.json").exists()
        assert m.gauges()[("sentinel_backend_up", (("backend", "slurm"),))] == 0.0
    finally:
        m.close()
        ep.close()
        rank.close()


def test_the_breaker_refuses_past_half_the_partition_and_the_job_still_snapshots(clean, tmp_path):
    for node in ("node1", "node2"):  # two of four nodes drained by Sentinel just now
        backend(clean, tmp_path / node, node).cordon(REASON)
    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    rank = RankEndpoint.open(run_dir)
    (tmp_path / "state").mkdir()
    m = Migrator(ActionsConfig(backend="slurm", command_timeout_seconds=5.0, ack_timeout_seconds=0.5), ep,
                 state_dir=tmp_path / "state", runtime_dir=run_dir, node="node3", signal_agent=lambda rec, sig: None,
                 workers=concurrent.futures.ThreadPoolExecutor(2))
    m.backend.ctx.env = clean.env
    try:
        trip = Trip(rule="xid", action="migrate", gpu=1, cause="xid:79", message="Xid 79 on GPU 1", values={})
        m.begin("r3", trip)
        req = rank.poll()[0]
        assert req.type == "migrate" and req.id == "r3"  # the snapshot request left first, before any count
        wait_for(lambda: (m.tick([]), m.record.phase)[1] in ("refused", "drained"), timeout=30, what="breaker verdict")
        assert m.record.phase == "refused"
        assert "DRAIN" not in clean.node("node3")["State"]  # drained, recounted, lost, resumed
        assert not (tmp_path / "state" / "cordon.json").exists()
        assert m.metric_counters()[("sentinel_breaker_refusals", (("backend", "slurm"),))] == 1
        assert any("2 other of 4 nodes were cordoned by Sentinel" in n and "75% > 50%" in n for n in m.record.notes)
        # one Sentinel drain fewer: 2 of 4 after this one is not more than half, so node3 may go
        clean.run("scontrol", "update", "nodename=node2", "state=resume")
        m.begin("r4", trip)
        wait_for(lambda: (m.tick([]), m.record.phase)[1] in ("refused", "drained"), timeout=30, what="breaker verdict")
        assert m.record.phase == "drained" and m.record.scheduler_cordoned is True
        assert "DRAIN" in clean.node("node3")["State"]
    finally:
        m.close()
        ep.close()
        rank.close()


def drained_by_sentinel(slurm) -> set[str]:
    out = slurm.run("sinfo", "-h", "-N", "-o", "%N|%T|%E").stdout
    return {line.split("|")[0] for line in out.splitlines()
            if "drain" in line.split("|")[1] and line.split("|", 2)[2].startswith("sentinel:")}


def test_a_burst_of_trips_never_drains_more_than_the_fraction(clean, tmp_path):
    """Xid 79 on 3 of 4 nodes within ~0.25 s, five times: each node's claim (drain, recount, the
    deterministic loser resumes itself) runs at once on its own thread against the real
    slurmctld; at no point after a burst are more than half the nodes drained by Sentinel."""
    import random

    rng = random.Random(24)
    for rep in range(5):
        nodes = rng.sample(["node1", "node2", "node3", "node4"], 3)
        claimers = [backend(clean, tmp_path / f"{rep}-{n}", n) for n in nodes]
        start = threading.Barrier(len(claimers))
        delays = [rng.uniform(0, 0.25) for _ in claimers]

        def claim(b, delay):
            start.wait(10)
            time.sleep(delay)
            return b.claim_cordon(REASON)

        with concurrent.futures.ThreadPoolExecutor(len(claimers)) as pool:
            verdicts = list(pool.map(claim, claimers, delays))
        kept = drained_by_sentinel(clean)
        won = {b.node for b, v in zip(claimers, verdicts) if v.allowed}
        assert len(kept) <= 2, (rep, kept, [v.why for v in verdicts])
        assert kept == won, (rep, kept, won)  # a node that lost resumed itself; one that won stays drained
        clean.reset_nodes()


def test_healthcheck_drains_an_unwatched_node_and_sentinel_uncordon_resumes_it(clean, tmp_path):
    env = {**clean.env, "PYTHONPATH": str(REPO), "SENTINEL": f"{sys.executable} -m sentinel"}
    r = subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "sentinel-healthcheck"), "--drain", "--node", "node3",
                        "--runtime-dir", str(tmp_path / "no-daemon")], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 3 and r.stdout.startswith("SENTINEL UNKNOWN")
    node = clean.node("node3")
    assert "DRAIN" in node["State"] and node["Reason"].startswith("sentinel: healthcheck UNKNOWN")
    # an admin's drain is never replaced by the health check's
    clean.run("scontrol", "update", "nodename=node4", "state=drain", "reason=admin: cabling")
    subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "sentinel-healthcheck"), "--drain", "--node", "node4",
                    "--runtime-dir", str(tmp_path / "no-daemon")], capture_output=True, text=True, timeout=60, env=env)
    assert clean.node("node4")["Reason"] == "admin: cabling"
    r = sentinel_cli(clean, "uncordon", "--config", str(write_config(tmp_path, "node3")))
    assert r.returncode == 0 and "node3 resumed" in r.stdout
    assert "DRAIN" not in clean.node("node3")["State"]


def test_a_daemon_with_the_slurm_backend_exports_that_the_scheduler_answers(slurm, tmp_path, sim_state):
    cfg = write_config(tmp_path, "node1")
    env = {**slurm.env, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sentinel", "run", "--config", str(cfg), "--simulate", str(sim_state),
                             "--no-ebpf"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        status = tmp_path / "run-node1" / "status.json"
        wait_for(lambda: status.exists() or proc.poll() is not None, timeout=30, what="daemon status")
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
        port = json.loads(status.read_text())["metrics_port"]
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert metric_value(text, "sentinel_backend_up", backend="slurm") == 1.0
        assert metric_value(text, "sentinel_breaker_refusals_total", backend="slurm") == 0.0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def test_the_spare_signal_reaches_only_the_job_of_this_nodes_agent(clean, tmp_path, attacker):
    """The spare request (`scancel --batch --signal=USR1`) kills a batch script that does not trap
    it, so it must reach the job this node's agent runs in and nothing else: not an unprivileged
    user's job that merely runs on the node, whether Sentinel has no agent there or one of
    another user (root's, outside any job)."""
    sub = subprocess.run(["sbatch", "--parsable", "-w", "node4", "-N1", "--output=/dev/null", "--chdir=/tmp",
                          "--wrap", "exec sleep 120"], user=attacker.uid, group=attacker.gid, extra_groups=[],
                         env={"SLURM_CONF": clean.env["SLURM_CONF"], "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                         capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]

    def state():
        return clean.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip()

    try:
        wait_for(lambda: state() == "RUNNING", timeout=30, what=f"the user's job {job} running")
        b = backend(clean, tmp_path, "node4")
        assert "no agent on node4" in b.start_spare()  # Sentinel has no agent here: nobody is signalled
        register_agent(tmp_path / "run")  # root's agent, in no Slurm job
        said = b.start_spare()
        assert "runs in no job of its user on node4" in said, said
        time.sleep(2)  # an untrapped SIGUSR1 ends the batch script at once
        assert state() == "RUNNING"
        # the user's own agent, inside the user's job: that job, and only it, is asked for a spare
        inside = wait_for(lambda: subprocess.run(["pgrep", "-u", str(attacker.uid), "-x", "sleep"], capture_output=True,
                                                 text=True).stdout.split(), timeout=10, what="the job's process")
        register_agent(tmp_path / "run", int(inside[0]))
        said = b.start_spare()
        assert f"asked job {job}'s batch script" in said, said
        wait_for(lambda: state() != "RUNNING", timeout=30, what="the batch script to take the signal")
    finally:
        clean.run("scancel", job)
