"""End to end through Slurm: `sentinel drill --scheduler slurm` (a real slurmctld + 4 slurmd, the
job submitted with deploy/slurm/train.sbatch), and the HealthCheckProgram wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

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
