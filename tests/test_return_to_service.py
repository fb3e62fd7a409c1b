"""`sentinel uncordon` returns the node to service in the RUNNING daemon: its cordon state, status.json
and `sentinel_node_cordoned` clear, and the next failure migrates again (issue #23, point 3)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, metric_value, wait_for
from sentinel.sources import simulated

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def drained(d) -> dict | None:
    s = d.status
    m = s["migration"]
    return s if s["cordoned"] and m and m["phase"] == "drained" else None


def test_uncordon_returns_the_running_daemon_to_service_and_the_next_xid_migrates_again(
        sim_state, start_daemon, shared_tmp, attacker):
    state_dir, runtime_dir = shared_tmp / "state", shared_tmp / "run"
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state_dir), runtime_dir=runtime_dir)

    simulated.inject(sim_state, 0, ["xid=79"])
    first = wait_for(lambda: drained(d), timeout=30, what="first migration drained")["migration"]["request_id"]
    wait_for(lambda: metric_value(d.scrape(), "sentinel_node_cordoned") == 1, timeout=20, what="the metric follows")  # published apart from status.json

    # another user cannot return the node to service: what `sentinel uncordon` removes lies in the
    # state directory, root's alone
    r = attacker.run(["rm", "-f", str(state_dir / "cordon.json"), str(state_dir / "migration.json")])
    assert r.returncode != 0 and "Permission denied" in r.stderr
    t = d.status["time"]
    wait_for(lambda: d.status["time"] > t + 0.5, timeout=20, what="a few more polls")
    assert d.status["cordoned"] and metric_value(d.scrape(), "sentinel_node_cordoned") == 1
    assert (state_dir / "cordon.json").exists()

    r = subprocess.run([sys.executable, "-m", "sentinel", "uncordon", "--state-dir", str(state_dir)],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0, r.stderr
    # the running daemon follows: not cordoned in status.json nor in the metric, no migration
    wait_for(lambda: not d.status["cordoned"] and d.status["migration"] is None, timeout=20, what="status uncordoned")
    wait_for(lambda: metric_value(d.scrape(), "sentinel_node_cordoned") == 0, timeout=20, what="the metric follows")  # published apart from status.json
    assert all(g["health"] == "healthy" for g in d.status["gpus"])

    # the next failure is handled like the first: a new migration, cordoned again
    simulated.inject(sim_state, 0, ["xid=79"])
    second = wait_for(lambda: drained(d), timeout=30, what="second migration drained")["migration"]["request_id"]
    assert second != first
    text = d.scrape()
    assert metric_value(text, "sentinel_node_cordoned") == 1
    assert metric_value(text, "sentinel_migration_steps_total", step="started") == 2
    assert metric_value(text, "sentinel_migration_steps_total", step="returned_to_service") == 1
    assert metric_value(text, "sentinel_migration_steps_total", step="already_migrating") is None
    assert (state_dir / "cordon.json").exists()
