"""A misbehaving scheduler or API server can neither stop the daemon nor stall a migration, and
nothing it does delays the snapshot request (issue #24, points 8-13). Slurm: stub
``scontrol``/``sinfo``/``squeue``/``scancel`` on PATH (tests/slurm_stub.py). Kubernetes: a
loopback API server that answers badly or slowly (tests/kube_stub.py). The real-scheduler
counterparts (bursts on a real slurmctld and kube-apiserver) are in test_slurm.py and
test_kubernetes.py."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, register_agent, wait_for
from kube_stub import KubeStub
from slurm_stub import SlurmStub
from sentinel.backends import make_backend
from sentinel.backends.base import Backend, BackendContext, CordonReason, Unreachable, Verdict
from sentinel.backends.slurm import job_id
from sentinel.builder import check_backend
from sentinel.channel import RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig, KubernetesConfig
from sentinel.migration import Migrator
from sentinel.policy import Trip
from sentinel.procs import AgentRecord

TRIP = Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79 on GPU 0", values={"xid": 79})
REASON = CordonReason("xid", 0, "Xid 79 on GPU 0", "r1")
SIGNALS: list = []  # the agent is this test process: its stop is recorded, never sent


@pytest.fixture
def stub(tmp_path):
    return SlurmStub(tmp_path / "slurm")


@pytest.fixture
def kube():
    k = KubeStub()
    yield k
    k.stop()


def slurm_backend(stub, tmp_path, node="n1", read_agent=None, **actions):
    (tmp_path / "state").mkdir(exist_ok=True)
    actions.setdefault("command_timeout_seconds", 5.0)
    return make_backend(ActionsConfig(backend="slurm", **actions), BackendContext(
        node=node, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", timeout=actions["command_timeout_seconds"],
        wall=time.time, env=stub.env, read_agent=read_agent, signal_agent=SIGNALS.append))


def kube_backend(kube, tmp_path, node="n1", **actions):
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    actions.setdefault("command_timeout_seconds", 5.0)
    cfg = ActionsConfig(backend="kubernetes", kubernetes=KubernetesConfig(kubeconfig=str(kube.kubeconfig(tmp_path / "kc"))),
                        **actions)
    return make_backend(cfg, BackendContext(node=node, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                                            timeout=actions["command_timeout_seconds"], wall=time.time,
                                            signal_agent=SIGNALS.append))


class Job:
    """The node's job: a registered agent (this process) and one rank endpoint."""

    def __init__(self, tmp_path, backend, **actions) -> None:
        run = tmp_path / "run"
        register_agent(run)
        self.ep = DaemonEndpoint(run)
        self.rank = RankEndpoint.open(run)
        actions.setdefault("ack_timeout_seconds", 0.3)
        self.m = Migrator(ActionsConfig(backend=backend.name, **actions), self.ep, state_dir=tmp_path / "state",
                          runtime_dir=run, node=backend.node, backend=backend, signal_agent=lambda rec, sig: None,
                          workers=concurrent.futures.ThreadPoolExecutor(2))

    def until(self, phases, timeout=30):
        return wait_for(lambda: (self.m.tick([]), self.m.record.phase in phases)[1], timeout=timeout,
                        what=f"migration phase in {phases} (now {self.m.record.phase})")

    def close(self):
        self.m.close()
        self.ep.close()
        self.rank.close()


# -- 8. bytes that are not UTF-8 ---------------------------------------------------------------
def daemon_config(tmp_path, node, backend="slurm", extra="") -> str:
    path = tmp_path / f"{node}.toml"
    path.write_text(f'[daemon]\nnode_name = "{node}"\npoll_interval_seconds = 0.2\n'
                    f'[actions]\nbackend = "{backend}"\ncommand_timeout_seconds = 5.0\n{extra}'
                    '[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    return str(path)


def test_a_non_utf8_byte_from_scontrol_does_not_stop_the_daemon_at_start(stub, tmp_path, sim_state, start_daemon):
    stub.drain("n1", "admin: fan", raw=b" Comment=\xff\xfe\x80")
    d = start_daemon("--config", daemon_config(tmp_path, "n1"), "--simulate", str(sim_state), env=stub.env)
    assert d.proc.poll() is None, d.log()
    assert "Traceback" not in d.log() and "UnicodeDecodeError" not in d.log()
    assert any(c["prog"] == "scontrol" and c["argv"][:3] == ["show", "node", "n1"] for c in stub.calls())
    b = slurm_backend(stub, tmp_path)
    assert check_backend(b) is True
    state = b.is_cordoned()
    assert state.cordoned and not state.by_sentinel
    assert state.detail.startswith("admin: fan") and "\ufffd" in state.detail  # decoded with replacement


def test_a_non_utf8_drain_reason_on_another_node_does_not_hold_the_migration(stub, tmp_path):
    stub.drain("n2", "sentinel: xid gpu1 Xid 79", raw=b"\xff\xc3(")  # Sentinel's drain, then bytes that are not UTF-8
    stub.drain("n3", "admin: ", raw=b"\xfe\xfe")
    job = Job(tmp_path, slurm_backend(stub, tmp_path))
    try:
        job.m.begin("r1", TRIP)
        assert [(r.type, r.id) for r in job.rank.poll()] == [("migrate", "r1")]
        job.until({"drained"})
        assert job.m.record.scheduler_cordoned is True  # n2's and n1's drains: 2 of 4, within half
        assert stub.read()["nodes"]["n1"]["reason"].startswith("sentinel: xid")
        assert any("breaker" in n and "1 other of 4 nodes" in n for n in job.m.record.notes), job.m.record.notes
    finally:
        job.close()


# -- 9. job ids ------------------------------------------------------------------------------
@pytest.mark.parametrize("text,ok", [("1234", True), ("1234_5", True), ("1234_[1-3,7%2]", True), ("1234+0", True),
                                     ("-5", False), ("--signal=KILL", False), ("12 3", False), ("12a", False),
                                     ("", False), ("1234_", False)])
def test_job_ids_are_what_slurm_prints(text, ok):
    assert (job_id(text) is not None) is ok


def agent_here(_path):
    return AgentRecord.of(os.getpid())


def test_a_job_id_that_looks_like_an_option_never_reaches_scancel(stub, tmp_path):
    b = slurm_backend(stub, tmp_path, read_agent=agent_here)
    stub.update(squeue=b"-5\n--signal=KILL\n".hex())
    said = b.start_spare()
    assert "runs in no job" in said
    assert not [c for c in stub.calls() if c["prog"] == "scancel"]
    assert any("not job ids" in n and "'-5'" in n for n in b.take_notes())
    stub.update(squeue=b"--batch\n4242_7\n".hex())  # one real job among junk: only it is signalled, after --
    said = b.start_spare()
    assert "job 4242_7" in said
    [cancel] = [c for c in stub.calls() if c["prog"] == "scancel"]
    assert cancel["argv"] == ["--batch", "--signal=USR1", "--", "4242_7"]


def test_a_node_name_that_looks_like_an_option_is_refused(stub, tmp_path):
    from sentinel.backends.base import BackendError

    with pytest.raises(BackendError, match="not a Slurm NodeName"):
        slurm_backend(stub, tmp_path, node="-oops")


# -- 12. the snapshot request leaves first ---------------------------------------------------
class Recorded:
    """The daemon's side, instrumented: every scheduler command's start and return, and every
    request sent to the ranks, as events in order, from this one process."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def add(self, kind: str, what: str) -> None:
        with self.lock:
            self.events.append((kind, what))

    def run(self, argv, **kw):
        self.add("call", os.path.basename(argv[0]))
        try:
            return subprocess.run(argv, **kw)
        finally:
            self.add("returned", os.path.basename(argv[0]))


def test_with_the_controller_hung_the_snapshot_request_leaves_before_any_scheduler_call(stub, tmp_path):
    stub.update(hang=True)  # every scontrol/sinfo/squeue hangs until killed
    rec = Recorded()
    b = slurm_backend(stub, tmp_path, read_agent=agent_here, command_timeout_seconds=1.0)
    b.ctx.run = rec.run
    job = Job(tmp_path, b, command_timeout_seconds=1.0, scheduler_attempts=1)
    send = job.ep.request

    def request(kind, *a, **kw):
        n = send(kind, *a, **kw)
        rec.add("request", kind)
        return n

    job.ep.request = request
    try:
        job.m.begin("r1", TRIP)
        got = job.rank.poll()
        assert [(r.type, r.id) for r in got] == [("migrate", "r1")]
        first_call = next((i for i, e in enumerate(rec.events) if e[0] == "call"), len(rec.events))
        assert ("request", "migrate") in rec.events[:first_call]  # sent before any scheduler call even began
        job.until({"drained"})  # and the migration moved on in the fail-safe direction
        assert job.m.record.scheduler_cordoned is False and job.m.cordoned
        assert (tmp_path / "state" / "cordon.json").exists()
        assert any("did not finish within 1 s" in n for n in job.m.record.notes), job.m.record.notes
    finally:
        job.close()


class Stuck(Backend):
    """A backend whose cordon ignores every timeout until released."""

    name = "stuck"
    has_scheduler = True
    has_fleet = True

    def __init__(self, actions, ctx) -> None:
        super().__init__(actions, ctx)
        self.release = threading.Event()

    def claim_cordon(self, reason):
        self.release.wait(60)
        return Verdict(True, 0, 4, "released")


def test_a_backend_step_past_its_phase_deadline_is_left_behind_and_counted(tmp_path):
    class Clock:
        t = 1000.0

        def __call__(self):
            return self.t

    clock = Clock()
    (tmp_path / "state").mkdir()
    kills = []
    b = Stuck(ActionsConfig(), BackendContext(node="n1", state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                                              timeout=1.0, wall=clock, signal_agent=lambda r, s: kills.append(s)))
    run = tmp_path / "run"
    register_agent(run)
    ep = DaemonEndpoint(run)
    m = Migrator(ActionsConfig(ack_timeout_seconds=1.0, command_timeout_seconds=1.0, scheduler_attempts=1), ep,
                 state_dir=tmp_path / "state", runtime_dir=run, node="n1", wall=clock, backend=b,
                 )  # the Migrator's own workers
    try:
        m.begin("r1", TRIP)
        clock.t += 2  # no ack within the ack timeout
        m.tick([])
        assert m.record.phase == "acknowledged"
        m.tick([])
        assert m.record.phase == "acknowledged"  # the claim hangs; within its deadline the tick waits
        clock.t += m.phase_deadline_seconds + 1
        m.tick([])
        assert m.record.phase == "cordoned" and m.cordoned  # moved on: cordoned locally
        assert (tmp_path / "state" / "cordon.json").exists()  # `sentinel launch` refuses on this node
        wait_for(lambda: (m.tick([]), m.record.phase == "drained")[1], timeout=10, what="drained")
        assert kills  # the agent is stopped although the claim still hangs
        counts = m.metric_counters()
        assert counts[("sentinel_migration_deadline_exceeded", (("phase", "acknowledged"),))] == 1
        assert counts[("sentinel_migration_deadline_exceeded", (("phase", "cordoned"),))] == 0
        assert m.record.scheduler_cordoned is False  # retried at later polls
        assert any("did not finish within" in n for n in m.record.notes)
    finally:
        b.release.set()
        m.close()
        ep.close()


# -- 10. a bad API server ------------------------------------------------------------------------
def test_a_node_list_item_without_spec_does_not_hold_the_migration(kube, tmp_path):
    kube.node_list_items = [{"metadata": {"name": "n2"}}, {"metadata": {}}, {}, kube.nodes["n1"]]
    job = Job(tmp_path, kube_backend(kube, tmp_path))
    try:
        job.m.begin("k1", TRIP)
        assert job.rank.poll()[0].type == "migrate"
        job.until({"drained"})
        assert job.m.record.scheduler_cordoned is True, job.m.record.notes
        assert kube.nodes["n1"]["spec"].get("unschedulable") is True
    finally:
        job.close()


def test_an_access_review_without_status_does_not_crash_the_start(kube, tmp_path):
    kube.review = {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1"}  # the spec echoed, no status
    b = kube_backend(kube, tmp_path)
    with pytest.raises(Unreachable, match="without status.allowed"):
        b.check()
    assert check_backend(b) is False  # the daemon starts, saying the scheduler could not tell


def test_an_api_server_that_drips_is_cut_off_at_the_calls_total_deadline(kube, tmp_path):
    kube.drip_seconds = 0.05  # each byte well within a per-read timeout: only a total deadline ends it
    b = kube_backend(kube, tmp_path, command_timeout_seconds=1.0)
    with pytest.raises(Unreachable, match="total deadline"):
        b.check()
    job = Job(tmp_path, kube_backend(kube, tmp_path / "m", command_timeout_seconds=1.0),
              command_timeout_seconds=1.0, scheduler_attempts=1)
    try:
        job.m.begin("k1", TRIP)
        assert job.rank.poll()[0].type == "migrate"
        job.until({"drained"}, timeout=60)  # each call ends at 1 s: the migration moves on
        assert job.m.record.scheduler_cordoned is False and job.m.cordoned
    finally:
        job.close()


def test_hung_api_calls_are_bounded(kube, tmp_path):
    from sentinel.backends.kubernetes import MAX_HUNG

    kube.drip_seconds, kube.endless = 0.05, True  # answers that never end, a byte well within each read timeout
    b = kube_backend(kube, tmp_path, command_timeout_seconds=1.0)
    for _ in range(MAX_HUNG):
        with pytest.raises(Unreachable, match="total deadline"):
            b.scheduler_state()
    with pytest.raises(Unreachable, match="still hang"):  # refused at once: no fifth thread
        b.scheduler_state()


# -- 13. a stale status --------------------------------------------------------------------------
def test_the_healthcheck_says_unknown_on_a_stale_status(shared_tmp):
    status = {"pid": os.getpid(), "node": "n", "driver_version": "x", "metrics_port": 1, "cordoned": False,
              "migration": None, "gpus": [{"index": 0, "health": "healthy", "lost": False, "hung": False,
                                           "pci_bus_id": "0000:18:00.0", "values": {}, "xid_counts": {},
                                           "forecast_seconds": None}]}
    env = {**os.environ, "PYTHONPATH": str(REPO), "SENTINEL": f"{sys.executable} -m sentinel"}

    def healthcheck(**fields):
        (shared_tmp / "status.json").write_text(json.dumps({**status, **fields}))
        return subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "sentinel-healthcheck"), "--runtime-dir",
                               str(shared_tmp)], capture_output=True, text=True, timeout=60, env=env)

    r = healthcheck(time=time.time())
    assert r.returncode == 0 and r.stdout.startswith("SENTINEL OK"), r.stdout + r.stderr
    r = healthcheck(time=time.time() - 3600)  # the daemon stopped writing an hour ago (its pid still alive)
    assert r.returncode == 3 and r.stdout.startswith("SENTINEL UNKNOWN - stale status"), r.stdout
    r = healthcheck()  # no time at all: cannot tell
    assert r.returncode == 3 and "UNKNOWN" in r.stdout, r.stdout
