"""Every bench in bench/ runs in the suite: ``--smoke`` (smallest sizes, a few seconds each), and
its ``--json`` report must hold every figure the bench promises (its module-level ``SMOKE_FIGURES``),
each a finite number. Never how fast: a broken bench is a failing test, a slow one is not.

Benches are discovered (every ``bench/*.py`` not starting with ``_``), so a new bench without a
``--smoke`` mode or without ``SMOKE_FIGURES`` fails here until it has both.
"""

from __future__ import annotations

import ast
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# measure_all drives the others (tests/test_benchmarks_doc.py covers it); every other script is a bench
DRIVERS = {"measure_all"}
BENCHES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_") and p.stem not in DRIVERS)
LIMIT_S = 1500  # a smoke run is seconds on a quiet machine; this only bounds a hung one (hosts here reach load 200)


def promised(name: str) -> tuple[str, ...]:
    """The bench's ``SMOKE_FIGURES``, read from its source (no import: some import torch)."""
    tree = ast.parse((REPO / "bench" / f"{name}.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "SMOKE_FIGURES" for t in targets):
                try:
                    return tuple(ast.literal_eval(node.value))
                except ValueError:  # computed: import the module to read it
                    return tuple(_import_value(name))
    raise AssertionError(f"bench/{name}.py names no SMOKE_FIGURES: every bench promises the figures its --smoke writes")


def _import_value(name: str) -> tuple[str, ...]:
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'bench')!r}); import {name} as m;"
            "print(json.dumps(list(m.SMOKE_FIGURES)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    return tuple(json.loads(r.stdout.strip().splitlines()[-1]))


def test_every_bench_is_discovered():
    # the list the parametrised test runs is bench/, not a hand-kept copy of it
    assert {"ebpf_latency", "migration", "snapshot_stall", "nvml_device_check"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke(name: str, tmp_path: Path):
    figures = promised(name)
    assert figures, f"bench/{name}.py promises no figures"
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "SENTINEL_BENCH_TMP": str(tmp_path)})
    assert r.returncode == 0, f"bench/{name}.py --smoke failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["bench"] == name
    assert doc["host"]["command"][1:] == [str(REPO / "bench" / f"{name}.py"), "--smoke", "--json", str(out)]
    assert len(doc["host"]["loadavg"]) == 3 and "commit" in doc["host"]
    got = doc["figures"]
    missing = [f for f in figures if f not in got]
    assert not missing, f"bench/{name}.py --smoke did not write {missing}"
    bad = {f: got[f] for f in figures if not (isinstance(got[f], (int, float)) and math.isfinite(got[f]))}
    assert not bad, f"bench/{name}.py wrote non-finite figures {bad}"
    # the simulator's reader takes every bench's report as it is
    from sentinel_tools.sim import measured
    assert measured.load(out)[0].bench == name


def test_migration_killed_mid_run_keeps_the_finished_drills(tmp_path: Path):
    """bench/migration.py appends each drill as it finishes: SIGKILL after the first drill (seen in
    the JSON) leaves that drill, and the figures computed from it, in the file."""
    out = tmp_path / "migration.json"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "migration.py"), "--smoke", "--runs", "3",
                             "--only", "warm", "--json", str(out)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    doc = None
    try:
        end = time.monotonic() + LIMIT_S
        while time.monotonic() < end and proc.poll() is None:
            if out.exists():
                doc = json.loads(out.read_text())  # written atomically: never half a file
                if doc.get("runs"):
                    break
            time.sleep(0.2)
        assert proc.poll() is None, "the bench ended before it could be killed mid-run (3 drills asked)"
        os.killpg(proc.pid, signal.SIGKILL)  # the bench and the drill it is running now
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    after = json.loads(out.read_text())
    assert after["runs"], "the finished drill is kept"
    run = after["runs"][0]
    assert run["path"] == "warm" and run["drill"]["ok"], run["drill"].get("error")
    assert math.isfinite(after["figures"]["migration_trip_to_first_step_seconds"])
    assert after["figures"]["migration_ok_fraction"] == 1.0
    assert after["host"]["command"][-4:] == ["--only", "warm", "--json", str(out)]


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
