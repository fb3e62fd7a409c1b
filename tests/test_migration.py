"""The migration sequence in the daemon: phases, persistence, cordon, agent stop, failures."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess

from conftest import register_agent
from sentinel.channel import Ack, RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig
from sentinel.migration import Migrator, uncordon
from sentinel.policy import Trip
from sentinel.procs import AgentRecord

TRIP = Trip(rule="xid", action="migrate", gpu=3, cause="xid:79", message="Xid 79 on GPU 3", values={"xid": 79})


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(tmp_path, endpoint, clock=None, kills=None, runs=None, **actions):
    kills = kills if kills is not None else []
    runs = runs if runs is not None else []

    def run(argv, **kw):
        runs.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "state").mkdir(exist_ok=True)
    # the agent: a fake record (pid 4242) for the signal, which the tests capture instead of sending
    agent = AgentRecord(4242, 1, "/usr/bin/python3", 0, "")
    if any(k.endswith("_command") for k in actions):
        actions.setdefault("backend", "command")
    return Migrator(ActionsConfig(**actions), endpoint, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                    node="n1", wall=clock or Clock(), run=run, read_agent=lambda _p: agent,
                    signal_agent=lambda rec, sig: kills.append((rec.pid, sig)), workers=Inline())


class Inline(concurrent.futures.Executor):
    """Runs cordon/drain steps at once (the daemon runs them on a worker thread; see
    test_actions_run_off_the_loop for that)."""

    def submit(self, fn, *args, **kwargs):
        f = concurrent.futures.Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001
            f.set_exception(exc)
        return f


def advance(m, acks=None, rounds=4):
    """One daemon poll's worth of ticks: the acks, then the steps they unlock."""
    m.tick(acks or [])
    for _ in range(rounds):
        m.tick([])


def test_full_sequence_with_acks(tmp_path):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    kills, runs = [], []
    m = make(tmp_path, ep, kills=kills, runs=runs, cordon_command=("scontrol", "drain", "{node}"),
             spare_command=("start-spare", "{node}"))
    try:
        m.begin("r1", TRIP)
        assert m.record.phase == "requested" and m.record.ranks == 1
        assert runs == [["start-spare", "n1"]]
        req = rank.poll()[0]
        assert req.type == "migrate" and "Xid 79" in req.reason
        m.tick([])
        assert m.record.phase == "requested" and not m.cordoned  # waits for the ack
        rank.ack(Ack(id="r1", rank=0, step=77, ok=True, path="/s/step-77"))
        advance(m, ep.poll_acks())
        assert m.record.phase == "drained" and m.cordoned and m.record.snapshot_step == 77
        assert kills == [(4242, signal.SIGTERM)]
        assert runs[-1] == ["scontrol", "drain", "n1"]
        marker = json.loads((tmp_path / "state" / "cordon.json").read_text())
        assert marker["node"] == "n1" and "Xid 79" in marker["reason"]
        m.begin("r2", TRIP)  # a second trip never starts a second migration
        assert m.record.request_id == "r1" and m.counts["already_migrating"] == 1
    finally:
        rank.close()
        ep.close()


def test_restart_mid_sequence_resumes_instead_of_starting_again(tmp_path):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep)
        m.begin("r1", TRIP)
        rank.poll()
        # the daemon restarts: a new Migrator over the same state directory
        kills = []
        m2 = make(tmp_path, ep, kills=kills)
        assert m2.active and m2.record.request_id == "r1" and any("restarted" in n for n in m2.record.notes)
        m2.begin("r9", TRIP)
        assert m2.record.request_id == "r1" and rank.poll() == []  # no second request to the ranks
        rank.ack(Ack(id="r1", rank=0, step=5, ok=True))
        advance(m2, ep.poll_acks())
        assert m2.record.phase == "drained" and kills
    finally:
        rank.close()
        ep.close()


def test_failed_snapshot_still_drains_and_says_so(tmp_path):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    kills = []
    try:
        m = make(tmp_path, ep, kills=kills)
        m.begin("r1", TRIP)
        rank.ack(Ack(id="r1", rank=0, step=12, ok=False, error="OSError: [Errno 28] No space left on device"))
        advance(m, ep.poll_acks())
        assert m.record.phase == "drained" and m.record.snapshot_ok is False and kills
        assert any("previous snapshot" in n for n in m.record.notes)
    finally:
        rank.close()
        ep.close()


def test_ack_timeout_and_no_ranks(tmp_path):
    clock = Clock()
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep, clock=clock, ack_timeout_seconds=30.0)
        m.begin("r1", TRIP)
        clock.t += 29
        m.tick([])
        assert m.record.phase == "requested"
        clock.t += 2
        advance(m)
        assert m.record.phase == "drained" and any("0/1 ranks" in n for n in m.record.notes)
    finally:
        rank.close()
        ep.close()
    uncordon(tmp_path / "state")
    register_agent(tmp_path / "run2")
    ep2 = DaemonEndpoint(tmp_path / "run2")
    m = make(tmp_path, ep2)
    m.begin("r2", TRIP)  # no ranks on this node
    advance(m)
    assert m.record.phase == "drained" and any("no trainer rank" in n for n in m.record.notes)
    ep2.close()


def test_launch_refuses_on_a_cordoned_node(tmp_path):
    import sys

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "cordon.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "sentinel", "launch", "--pidfile", str(tmp_path / "a.pid"),
                        "--state-dir", str(tmp_path / "state"), "--", "true"], capture_output=True, text=True)
    assert r.returncode == 3 and "cordoned" in r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "uncordon", "--state-dir", str(tmp_path / "state")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not (tmp_path / "state" / "cordon.json").exists()
    pidfile = tmp_path / "a.pid"
    r = subprocess.run([sys.executable, "-m", "sentinel", "launch", "--pidfile", str(pidfile),
                        "--state-dir", str(tmp_path / "state"), "--", "sh", "-c",
                        f"echo $$; for i in $(seq 100); do [ -s {pidfile} ] && break; sleep 0.05; done; head -n 1 {pidfile}"],
                       capture_output=True, text=True, timeout=30)
    agent_pid, recorded = r.stdout.split()
    assert r.returncode == 0 and agent_pid == recorded  # the pidfile names the agent while it runs
    assert not pidfile.exists()  # and is removed when it exits


def test_ranks_that_exit_before_acknowledging_do_not_stall_the_drain(tmp_path):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    kills = []
    try:
        m = make(tmp_path, ep, kills=kills)
        m.begin("r1", TRIP)
        dead = subprocess.Popen(["true"])
        dead.wait()
        ep.requests["r1"].sent_to[dead.pid] = 0  # a rank the job restarted before it could answer
        rank.ack(Ack(id="r1", rank=0, step=9, ok=True))
        advance(m, ep.poll_acks())
        assert m.record.phase == "drained" and kills
        assert any("exited before acknowledging" in n for n in m.record.notes)
    finally:
        rank.close()
        ep.close()


def test_a_rank_that_is_a_zombie_counts_as_exited(tmp_path):
    """A rank killed but not yet reaped by its agent stays in /proc (state Z): it cannot answer,
    and the drain must not wait the acknowledgement timeout for it."""
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    zombie = subprocess.Popen(["true"])
    try:
        wait_for_zombie(zombie.pid)
        m = make(tmp_path, ep, kills=[])
        m.begin("r1", TRIP)
        ep.requests["r1"].sent_to[zombie.pid] = 0
        rank.ack(Ack(id="r1", rank=0, step=9, ok=True))
        advance(m, ep.poll_acks())
        assert m.record.phase == "drained"
        assert any("exited before acknowledging" in n for n in m.record.notes)
    finally:
        zombie.wait()
        rank.close()
        ep.close()


def wait_for_zombie(pid: int) -> None:
    from conftest import wait_for

    wait_for(lambda: open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z", timeout=30,
             what=f"pid {pid} to exit")


def test_running_reads_the_state_after_the_last_parenthesis(tmp_path):
    from sentinel.procs import running

    for pid, comm, state, want in ((10, "python3", "S", True), (11, "a) Z (b", "R", True), (12, "x", "Z", False),
                                   (13, "y", "X", False)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 2 3\n")
    assert [running(p, tmp_path) for p in (10, 11, 12, 13, 14)] == [True, True, False, False, False]
    assert running(__import__("os").getpid())
