"""End to end through Slurm: `sentinel drill --scheduler slurm` (a real slurmctld + 4 slurmd, the
job submitted with deploy/slurm/train.sbatch), and the HealthCheckProgram wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from sentinel_tools.drill_slurm import missing

pytestmark = [pytest.mark.needs_slurm, pytest.mark.slow]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def slurm_reset(slurm):
    yield slurm
    slurm.reset_nodes()  # the drill leaves node4 drained by its "admin"


def test_drill_through_slurm_drains_the_failed_node_and_finishes_on_the_spare(slurm_reset):
    """On the session's cluster (--slurm-conf), as `sentinel drill --scheduler slurm` runs on one it starts."""
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--scheduler", "slurm", "--json", "--timeout", "300",
                        "--slurm-conf", str(slurm_reset.conf)],
                       capture_output=True, text=True, timeout=420, env=ENV, cwd=str(REPO))
    assert r.stdout.lstrip().startswith("{"), r.stderr[-3000:]
    result = json.loads(r.stdout)
    s = result["slurm"]
    # the failed node is DRAINED in Slurm with Sentinel's reason
    assert s["sinfo_R"] == ["node2|drained|sentinel: xid gpu0 Xid 79 on GPU 0 (nvml)"]
    # the job finished on node1 + the spare node3 of its own allocation, with no step lost
    assert s["job_state"] == "COMPLETED"
    assert result["finished"] and result["final_nodes"] == ["node1", "node3"]
    assert result["spare_in_place"] and result["recomputed_steps"] == []
    assert any("SIGUSR1" in n for n in result["migration_notes"])
    # a new job avoids the drained node
    assert s["new_job_nodes"] == ["node1", "node3", "node4"]
    # sentinel uncordon returns it, and leaves an admin's drain alone
    assert "node2 resumed (it was Sentinel's drain" in s["uncordon"]
    assert "node4 is drained by someone else ('admin: replacing a fan'); left alone" in s["uncordon_admin"]
    assert s["ok_uncordon_returns_node"] and s["ok_admin_drain_left_alone"]
    assert result["ok"] and r.returncode == 0


def test_the_slurm_drill_refuses_a_cluster_it_cannot_find_and_a_conf_without_slurm(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--scheduler", "slurm", "--slurm-conf",
                        str(tmp_path / "nope.conf")], capture_output=True, text=True, timeout=60, env=ENV, cwd=str(REPO))
    assert r.returncode == 2 and f"--slurm-conf {tmp_path / 'nope.conf'}: no such file" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--slurm-conf", str(tmp_path / "nope.conf")],
                       capture_output=True, text=True, timeout=60, env=ENV, cwd=str(REPO))
    assert r.returncode == 2 and "--slurm-conf needs --scheduler slurm" in r.stderr, r.stderr


HEALTHCHECK = REPO / "deploy" / "slurm" / "sentinel-healthcheck"


def healthcheck(runtime_dir, *args):
    env = {**ENV, "SENTINEL": f"{sys.executable} -m sentinel"}
    return subprocess.run(["sh", str(HEALTHCHECK), "--runtime-dir", str(runtime_dir), "--node", "nodeX", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_healthcheck_speaks_nagios(sim_state, start_daemon, tmp_path):
    from conftest import wait_for
    from sentinel.sources import simulated

    r = healthcheck(tmp_path / "nothing-here")
    assert r.returncode == 3 and r.stdout.startswith("SENTINEL UNKNOWN - no running sentinel daemon")
    d = start_daemon("--simulate", str(sim_state))
    r = healthcheck(d.runtime_dir)
    assert (r.returncode, r.stdout.strip()) == (0, "SENTINEL OK - 4 GPU(s) healthy")
    simulated.inject(sim_state, 2, ["xid=79"])
    wait_for(lambda: healthcheck(d.runtime_dir).returncode == 2, timeout=30, what="CRITICAL")
    r = healthcheck(d.runtime_dir)
    assert r.stdout.startswith("SENTINEL CRITICAL - ") and ("GPU 2 failed" in r.stdout or "cordoned by sentinel" in r.stdout)


@pytest.fixture
def user_python():
    """The test interpreter (torch and all) where an ordinary user can run it: it lives under /root
    (0700), so a read-only bind mount shows it under /opt for the test's length; its libpython is
    found through LD_LIBRARY_PATH (its RUNPATH names /root). On a cluster this is the shared Python."""
    import shutil
    import tempfile
    from pathlib import Path

    prefix = Path(sys.base_prefix)
    os.makedirs("/opt", exist_ok=True)
    mnt = Path(tempfile.mkdtemp(prefix="sentinel-test-py-", dir="/opt"))
    os.chmod(mnt, 0o755)
    r = subprocess.run(["mount", "--bind", str(prefix), str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], capture_output=True)
    try:
        exe = mnt / Path(sys.executable).resolve().relative_to(prefix.resolve())
        yield exe, mnt / "lib"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def test_an_ordinary_users_job_is_protected_through_slurm(attacker, user_python):
    """The job is submitted by an ordinary user with deploy/slurm/train.sbatch: its launchers cannot
    write the root-owned agent record, so they register with the node daemons, which check that each
    is a task of a Slurm job step (under a root slurmstepd) and record it. Xid 79 on node2 then goes
    through the ranks' snapshot, the drain and the spare with no step lost, as for root's jobs."""
    why = missing()
    if why:
        pytest.skip(f"needs {why}")
    python, libdir = user_python
    env = {**ENV, "LD_LIBRARY_PATH": str(libdir)}
    try:
        r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--scheduler", "slurm", "--json", "--timeout",
                            "300", "--user", attacker.name, "--job-python", str(python)],
                           capture_output=True, text=True, timeout=420, env=env, cwd=str(REPO))
    finally:  # the job's memory tier holder (/dev/shm/sentinel-<uid>) outlives it, as on a node
        import shutil

        shutil.rmtree(f"/dev/shm/sentinel-{attacker.uid}", ignore_errors=True)
    assert r.stdout.lstrip().startswith("{"), r.stderr[-3000:]
    result = json.loads(r.stdout)
    s = result["slurm"]
    assert s["job_user"] == f"{attacker.name}({attacker.uid})" and s["ok_job_ran_as_user"]
    assert s["ok_agent_registered"], s  # the victim's daemon recorded the user's launcher
    # Xid 79 -> the ranks' snapshot -> drain -> spare, no step lost
    committed = [e for e in result["timeline"] if e["stage"] == "snapshot committed"]
    assert committed and committed[0]["ok"] is True and committed[0]["step"] is not None
    assert any(n.startswith("sent SIGTERM to torchrun agent pid") for n in result["migration_notes"])
    assert s["sinfo_R"] == ["node2|drained|sentinel: xid gpu0 Xid 79 on GPU 0 (nvml)"]
    assert s["job_state"] == "COMPLETED"
    assert result["finished"] and result["final_nodes"] == ["node1", "node3"]
    assert result["spare_in_place"] and result["recomputed_steps"] == []
    assert result["ok"] and r.returncode == 0


def test_the_batch_script_refuses_a_command_without_an_elastic_rendezvous(tmp_path):
    """A job whose agents the first migration would kill (no elastic rendezvous, or c10d hosting its
    store in an agent) is refused before anything starts, naming the missing flag."""
    sbatch = REPO / "deploy" / "slurm" / "train.sbatch"

    def run(*argv):
        return subprocess.run(["bash", str(sbatch), *argv], capture_output=True, text=True, timeout=60,
                              env={**ENV, "TRAIN_NODES": "2"}, cwd=str(tmp_path))

    r = run("torchrun", "--nnodes=2", "--nproc-per-node=8", "train.py")
    assert r.returncode == 2 and "need an elastic rendezvous" in r.stderr
    r = run("torchrun", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "train.py")
    assert r.returncode == 2 and "--rdzv-conf=is_host=false" in r.stderr and "trainer.store" in r.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written
