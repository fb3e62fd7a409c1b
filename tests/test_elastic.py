"""`python -m trainer.elastic` and `sentinel launch --warm` / `sentinel admit`, one node, real
torch elastic agents against a real c10d store on loopback (the whole migration is in test_drill)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from sentinel_tools.drill import free_port

pytestmark = [pytest.mark.needs_torch]
pytest.importorskip("torch")

WORKER = r"""
import json, os, sys, time
out = sys.argv[1]
run = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(out, "a") as f:
    f.write(json.dumps({"run": run, "pid": os.getpid(), "time": time.time(),
                        "dynamo_preloaded": "torch._dynamo" in sys.modules,
                        "dcp_preloaded": "torch.distributed.checkpoint" in sys.modules}) + "\n")
if len(sys.argv) > 2 and sys.argv[2] == "fail":
    os._exit(75)
"""


@pytest.fixture
def store(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "trainer.store", "--port", str(port)], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            with socket.socket() as s:
                s.settimeout(0.2)
                return s.connect_ex(("127.0.0.1", port)) == 0
        wait_for(up, 60, what="the rendezvous store")
        yield port
    finally:
        p.terminate()
        try:
            p.wait(timeout=60)  # a store SIGTERMed on a host running two suites took over 10 s
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=60)


def _agent(tmp_path: Path, port: int, run_id: str, *, warm: bool, worker_args: list[str], max_restarts: int = 0):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "sentinel", "launch", "--pidfile", str(tmp_path / "agent.pid"), "--state-dir", str(state),
            *(["--warm"] if warm else []), "--",
            sys.executable, "-m", "trainer.elastic", "--ready-file", str(tmp_path / "warm.json"), "--",
            "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}", "--rdzv-conf=is_host=false,join_timeout=60", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", str(script), str(tmp_path / "runs.jsonl"), *worker_args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "agent.log", "w")
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _runs(tmp_path: Path) -> list[dict]:
    path = tmp_path / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rendezvous_state(port: int, run_id: str):
    """The c10d rendezvous state as torch stored it (None: nobody ever wrote one)."""
    import base64
    import pickle
    from datetime import timedelta

    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    raw = client.get("torch.rendezvous." + run_id)
    if raw == b"Y2FuaW1hZGFt":  # torch's "no state yet" sentinel
        return None
    return pickle.loads(base64.b64decode(raw))


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_warm_agent_waits_outside_the_rendezvous_then_runs_preloaded_workers_when_admitted(tmp_path, store):
    p = _agent(tmp_path, store, "warm-admit", warm=True, worker_args=[])
    try:
        wait_for(lambda: (tmp_path / "warm.json").exists() or p.poll() is not None, 120, what="the warm agent")
        assert p.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
        time.sleep(0.5)
        assert _runs(tmp_path) == []  # warm, not running
        state = _rendezvous_state(store, "warm-admit")
        assert state is None or not state.participants and not state.wait_list and not state.redundancy_list
        admitted_at = time.time()
        r = subprocess.run([sys.executable, "-m", "sentinel", "admit", "--pidfile", str(tmp_path / "agent.pid")],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        assert r.returncode == 0 and "admitted the agent pid" in r.stdout, r.stderr
        assert p.wait(timeout=120) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        _stop(p)
    (run,) = _runs(tmp_path)
    # a fork of the forkserver that imported torch and what torch imports lazily, after the admission
    assert run["dynamo_preloaded"] and run["dcp_preloaded"] and run["time"] >= admitted_at
    assert not (tmp_path / "agent.pid").exists()  # sentinel launch removed its record


def test_warm_agent_stopped_before_admission_exits_cleanly_without_running(tmp_path, store):
    p = _agent(tmp_path, store, "warm-stop", warm=True, worker_args=[])
    try:
        wait_for(lambda: (tmp_path / "warm.json").exists() or p.poll() is not None, 120, what="the warm agent")
        os.kill(p.pid, signal.SIGTERM)  # to sentinel launch, which forwards it
        assert p.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()[-3000:]
    finally:
        _stop(p)
    assert _runs(tmp_path) == []
    assert "before joining the rendezvous" in (tmp_path / "agent.log").read_text()


def test_admit_without_a_warm_agent_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel", "admit", "--pidfile", str(tmp_path / "none.pid")],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "no agent to admit" in r.stderr and "none.pid" in r.stderr
    bogus = tmp_path / "bogus.pid"
    bogus.write_text("garbage\n")
    r = subprocess.run([sys.executable, "-m", "sentinel", "admit", "--pidfile", str(bogus)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 1 and "not admitting" in r.stderr


def test_agent_restarts_failed_workers_on_a_healthy_node(tmp_path, store):
    p = _agent(tmp_path, store, "restart", warm=False, worker_args=["fail"], max_restarts=1)
    try:
        rc = p.wait(timeout=180)
    finally:
        _stop(p)
    assert [r["run"] for r in _runs(tmp_path)] == [0, 1] and rc != 0  # restarted once, then gave up


def test_node_being_drained_leaves_instead_of_restarting_its_workers(tmp_path, store):
    state = tmp_path / "state"
    state.mkdir()
    (state / "migration.json").write_text(json.dumps({"request_id": "r1", "node": "n", "phase": "requested",
                                                       "rule": "xid", "reason": "Xid 79"}))
    p = _agent(tmp_path, store, "drained", warm=False, worker_args=["fail"], max_restarts=3)
    try:
        rc = p.wait(timeout=180)
    finally:
        _stop(p)
    log = (tmp_path / "agent.log").read_text()
    assert rc == 0 and [r["run"] for r in _runs(tmp_path)] == [0], log[-3000:]
    assert "left the job: migration r1 is requested" in log
    state_after = _rendezvous_state(store, "drained")
    assert state_after is not None and not state_after.participants  # it removed itself


def test_leaving_reason(tmp_path):
    from sentinel.migration import leaving_reason

    assert leaving_reason(tmp_path) == ""
    (tmp_path / "migration.json").write_text(json.dumps({"request_id": "r9", "phase": "cordoned", "rule": "dbe",
                                                         "reason": "ECC"}))
    assert leaving_reason(tmp_path) == "migration r9 is cordoned: dbe: ECC"
    (tmp_path / "migration.json").write_text("{not json")
    assert leaving_reason(tmp_path) == "unreadable migration record"
    (tmp_path / "migration.json").unlink()
    (tmp_path / "cordon.json").write_text(json.dumps({"node": "n", "reason": "xid: 79", "request_id": "r"}))
    assert leaving_reason(tmp_path) == "node is cordoned: xid: 79"
    (tmp_path / "cordon.json").unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    (tmp_path / "cordon.json").symlink_to(tmp_path / "elsewhere.json")
    assert leaving_reason(tmp_path).startswith("node is cordoned (untrusted cordon marker")


def test_the_agent_process_ends_with_os_exit_after_flushing_its_output(tmp_path):
    # the agent skips the interpreter's teardown (0.7-0.9 CPU-s with torch loaded, spent on a
    # drained node after its work is done); what it printed and logged must still all be there
    log = tmp_path / "agent.log"
    code = (
        "import atexit, logging, sys\n"
        "from trainer.elastic import exit_now\n"
        f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
        f"atexit.register(lambda: open({str(tmp_path / 'teardown')!r}, 'w').close())\n"
        "logging.info('last log line')\n"
        "print('last stdout line', end='')\n"
        "sys.stderr.write('last stderr line')\n"
        "exit_now(7)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 7
    assert r.stdout == "last stdout line" and r.stderr == "last stderr line"
    assert "last log line" in log.read_text()
    assert not (tmp_path / "teardown").exists()  # the teardown (atexit and module clean-up) did not run
