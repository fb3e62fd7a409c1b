"""Every bench in bench/ runs in the suite: ``--smoke`` (smallest sizes, a few seconds each), and
its ``--json`` report must hold every figure the bench promises (its module-level ``SMOKE_FIGURES``),
each a finite number. Never how fast: a broken bench is a failing test, a slow one is not.

Benches are discovered (every ``bench/*.py`` not starting with ``_``), so a new bench without a
``--smoke`` mode or without ``SMOKE_FIGURES`` fails here until it has both. Each bench's smoke runs
once in the suite: here, or in the test named in ``bench_smoke.OWN_TEST`` (which checks the same and
more).
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench_smoke import BENCHES, KERNEL_LOG, LIMIT_S, OWN_TEST, REPO, check_report, command, run_smoke


def test_every_bench_is_discovered_and_its_smoke_runs_once():
    # the list the parametrised test runs is bench/, not a hand-kept copy of it
    assert {"ebpf_latency", "migration", "snapshot_stall", "nvml_device_check"} <= set(BENCHES)
    assert set(OWN_TEST) <= set(BENCHES) and set(KERNEL_LOG) <= set(BENCHES) - set(OWN_TEST)
    for name in set(BENCHES) - set(KERNEL_LOG):  # a bench that starts a daemon shares the kernel log
        src = (REPO / "bench" / f"{name}.py").read_text()
        assert '"sentinel", "run"' not in src and "build_daemon" not in src, (
            f"bench/{name}.py runs a daemon that reads the host's kernel log: add it to bench_smoke.KERNEL_LOG")
    for name, (path, test) in OWN_TEST.items():  # the test that runs it instead exists and runs it
        tree = ast.parse((REPO / path).read_text())
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == test), None)
        assert fn is not None, f"bench/{name}.py's smoke is left to {path}::{test}, which does not exist"
        calls = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        assert calls & {"run_smoke", "check_report"}, f"{path}::{test} does not check bench/{name}.py's smoke report"


@pytest.mark.parametrize("name", [pytest.param(b, marks=[pytest.mark.xdist_group("kernel")] if b in KERNEL_LOG else [])
                                  for b in BENCHES if b not in OWN_TEST])
def test_bench_smoke(name: str, tmp_path: Path):
    run_smoke(name, tmp_path)


def test_migration_killed_mid_run_keeps_the_finished_drills(tmp_path: Path):
    """bench/migration.py's smoke, killed mid-run: it appends each drill as it finishes, so SIGKILL
    once the first round (the smoke's warm and crash drills) is in the JSON, while the second round
    runs, leaves those drills and every figure the smoke promises in the file. This is the
    migration bench's smoke run in the suite (bench_smoke.OWN_TEST)."""
    out = tmp_path / "migration.json"
    cmd = command("migration", out, "--runs", "2")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        end = time.monotonic() + LIMIT_S
        while time.monotonic() < end and proc.poll() is None:
            if out.exists() and len(json.loads(out.read_text()).get("runs", [])) >= 2:  # written atomically
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"the bench ended (rc {proc.returncode}) before it could be killed mid-run (2 rounds asked)"
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and the drill it is running now
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    after = check_report("migration", out, cmd)  # every smoke figure, from the drills that finished
    assert [r["path"] for r in after["runs"]][:2] == ["warm", "crash"], "the finished drills are kept"
    for run in after["runs"][:2]:
        assert run["drill"]["ok"], run["drill"].get("error")
    assert after["figures"]["migration_ok_fraction"] == 1.0 and after["figures"]["crash_ok_fraction"] == 1.0


def test_results_are_written_run_by_run_with_their_provenance(tmp_path: Path):
    """bench/_report.Results: after each run the file holds every run so far and the figures of
    them, the load average, the commit and the command; the simulator's reader takes it."""
    sys.path.insert(0, str(REPO / "bench"))
    import _report
    from sentinel_tools.sim import measured

    out = tmp_path / "r.json"
    res = _report.Results(out, "example", lambda runs: {"example_median_seconds": sorted(r["s"] for r in runs)[len(runs) // 2]})
    res.add({"s": 2.0})
    first = json.loads(out.read_text())
    assert [r["s"] for r in first["runs"]] == [2.0] and first["figures"] == {"example_median_seconds": 2.0}
    res.add({"s": 4.0})
    res.add({"s": 3.0})
    doc = json.loads(out.read_text())
    assert [r["s"] for r in doc["runs"]] == [2.0, 4.0, 3.0] and doc["figures"]["example_median_seconds"] == 3.0
    assert all(len(r["loadavg"]) == 3 and r["finished"] for r in doc["runs"])
    assert doc["host"]["command"][0] == sys.executable and len(doc["host"]["loadavg"]) == 3
    assert doc["host"]["commit"].split("+")[0] == subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30).stdout.strip()
    (rep,) = measured.load(out)
    assert rep.figures == {"example_median_seconds": 3.0}
