"""`sentinel status` — and so the Slurm HealthCheckProgram that slurmd runs as root, which drains
or passes the node on its verdict — trusts only a status file the daemon (root) wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO

FORGED = {"pid": 1, "node": "n", "driver_version": "x", "metrics_port": 1, "cordoned": False, "migration": None,
          "gpus": [{"index": 0, "health": "healthy", "lost": False, "hung": False, "pci_bus_id": "0000:18:00.0",
                    "values": {}, "xid_counts": {}, "forecast_seconds": None}]}


def healthcheck(runtime: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SENTINEL": f"{sys.executable} -m sentinel"}
    return subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "sentinel-healthcheck"), "--runtime-dir", runtime],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.needs_root
def test_a_status_file_another_user_wrote_is_not_believed(attacker, shared_tmp):
    run = shared_tmp / "run"  # a runtime directory the user could write (a misconfiguration, or none made yet)
    run.mkdir()
    os.chown(run, attacker.uid, attacker.gid)
    forged = run / "status.json"
    r = attacker.python(f"open({str(forged)!r}, 'w').write({json.dumps(json.dumps(FORGED))})")
    assert r.returncode == 0 and forged.stat().st_uid == attacker.uid, r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "status", "--json", "--runtime-dir", str(run)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert f"not trusting {forged}" in r.stderr and f"owned by uid {attacker.uid}" in r.stderr
    hc = healthcheck(str(run))  # the healthcheck says it cannot tell; it never says OK for the user
    assert hc.returncode == 3 and hc.stdout.startswith("SENTINEL UNKNOWN"), hc.stdout
    # a symlink the user planted to the daemon's real status is not followed either
    real = shared_tmp / "real.json"
    real.write_text(json.dumps(FORGED))
    r = attacker.python(f"import os; os.remove({str(forged)!r}); os.symlink({str(real)!r}, {str(forged)!r})")
    assert r.returncode == 0, r.stderr
    hc = healthcheck(str(run))
    assert hc.returncode == 3 and "symlink" in hc.stdout, hc.stdout


@pytest.mark.needs_root
def test_the_daemons_own_status_file_is_read(shared_tmp):
    run = shared_tmp / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({**FORGED, "time": time.time()}))  # root's, as the daemon writes it
    hc = healthcheck(str(run))
    assert hc.returncode == 0 and hc.stdout.startswith("SENTINEL OK - 1 GPU(s) healthy"), hc.stdout + hc.stderr


@pytest.mark.needs_root
def test_the_healthcheck_imports_nothing_from_its_working_directory(attacker, shared_tmp):
    """slurmd, an NRPE agent or an admin's shell may start the healthcheck (as root) in a directory
    another user can write; a json.py planted there is never imported (root would run it, and it
    could answer OK for a node no daemon watches)."""
    cwd = shared_tmp / "cwd"
    cwd.mkdir()
    os.chown(cwd, attacker.uid, attacker.gid)
    pwned = shared_tmp / "pwned"
    planted = (f"import os, sys\nopen({str(pwned)!r}, 'w').write(str(os.geteuid()))\n"
               "print('0|forged: all GPUs healthy'); sys.exit()\n")
    r = attacker.python(f"open({str(cwd / 'json.py')!r}, 'w').write({planted!r})")
    assert r.returncode == 0, r.stderr
    # the installed `sentinel` script never puts the working directory on sys.path; -P does the same here
    env = {**os.environ, "PYTHONPATH": str(REPO), "SENTINEL": f"{sys.executable} -P -m sentinel"}
    hc = subprocess.run(["sh", str(REPO / "deploy" / "slurm" / "sentinel-healthcheck"), "--runtime-dir",
                         str(shared_tmp / "no-daemon")], capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
    assert not pwned.exists(), "root imported the user's json.py"
    assert hc.returncode == 3 and hc.stdout.startswith("SENTINEL UNKNOWN"), hc.stdout + hc.stderr
