"""Kubernetes pods are protected (issue #23, point 2): an agent in a pid namespace of its own, as in a
training pod, records its pid *in the pod*; the daemon (hostPID) maps it, and its ranks' socket
names, to the host's pids, sends the migrate request to the real ranks, takes their snapshot and
stops the real agent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO, wait_for
from sentinel import procs
from sentinel.sources import simulated


def test_an_agent_in_its_own_pid_namespace_is_snapshotted_and_stopped(sim_state, start_daemon, tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare (util-linux)")
    run, state, snaps = tmp_path / "run", tmp_path / "state", tmp_path / "snapshots"
    cfg = tmp_path / "sentinel.toml"
    cfg.write_text("[daemon]\npoll_interval_seconds = 0.2\n[actions]\nack_timeout_seconds = 60.0\n")
    d = start_daemon("--simulate", str(sim_state), "--config", str(cfg), runtime_dir=run)
    progress = tmp_path / "progress.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SENTINEL_RUNTIME_DIR": str(run), "OMP_NUM_THREADS": "1",
           "SENTINEL_MEMORY_DIR": str(tmp_path / "memory"), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "pod.log", "w")
    # the pod: a pid namespace of its own (the launcher is its pid 1), /proc of that namespace
    pod = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--", sys.executable, "-m", "sentinel", "launch",
         "--pidfile", str(run / "agent.pid"), "--state-dir", str(state), "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--monitor-interval=0.1",
         "-m", "trainer.train", "--steps", "100000", "--step-seconds", "0.05", "--snapshot-dir", str(snaps),
         "--progress", str(progress), "--migrate-hold-seconds", "60"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True)
    try:
        pidfile = run / "agent.pid"
        wait_for(pidfile.exists, timeout=60, what="the pod's agent record")
        written = json.loads(pidfile.read_text().splitlines()[1])
        assert written["pidns"] != procs.pid_namespace()  # written inside the pod: the pod's pid
        agent = procs.read_agent_record(pidfile)  # what the daemon does: the host's pid, verified
        assert agent.pid != written["pid"] and procs.ns_pids(agent.pid)[-1] == written["pid"]
        wait_for(lambda: progress.exists() and len(progress.read_text().splitlines()) >= 5, timeout=180,
                 what="the job's first steps")
        rank_names = [p.name for p in (run / "ranks").iterdir()]
        assert rank_names  # the rank's socket, named by its pid in the pod

        simulated.inject(sim_state, 0, ["xid=79"])
        mig = wait_for(lambda: (lambda m: m if m and m["phase"] == "drained" else None)(d.status["migration"]),
                       timeout=120, what="the migration drained")
        # the ranks were found and answered with a durable snapshot
        assert mig["ranks"] == 1 and mig["snapshot_ok"] is True and mig["snapshot_step"] is not None
        (ack,) = mig["acks"]
        assert ack["pid"] != int(rank_names[0].split(".")[0])  # acknowledged under its host pid
        assert any((snaps / n).is_dir() for n in os.listdir(snaps) if n.startswith("step-"))
        # the real agent was stopped: SIGTERM went to the host pid, and the pod ended
        assert f"sent SIGTERM to torchrun agent pid {agent.pid}" in mig["notes"]
        pod.wait(timeout=120)  # the pod's whole pid namespace ended
        with pytest.raises(ProcessLookupError):
            procs.proc_stat(agent.pid)
        log.flush()
        assert "Received 15 death signal" in (tmp_path / "pod.log").read_text()  # torchrun got the SIGTERM
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait(timeout=10)
        log.close()
