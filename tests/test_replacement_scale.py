"""bench/replacement_scale.py --smoke: it runs both handlers on a real store and writes every figure
it promises (the bench measures; this checks it measured, and what the rounds did)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench_smoke import run_smoke
from conftest import REPO

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]

sys.path.insert(0, str(REPO / "bench"))
import replacement_scale as bench  # noqa: E402


def test_smoke_produces_every_promised_figure_for_both_handlers(tmp_path):
    """Both handlers on the TCPStore and the slot handler on a 3-member etcd (--smoke runs both stores)."""
    # the bench's one smoke run in the suite (tests/bench_smoke.py OWN_TEST): what every bench's
    # smoke is checked for, then what the rounds did
    out = tmp_path / "runs.json"
    report, stdout = run_smoke("replacement_scale", tmp_path, "--out", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1
    run = runs[0]
    assert run["git_commit"] and "--smoke" in run["command"] and run["cpus"] >= 1
    rounds = run["rounds"]
    for handler in bench.HANDLERS:
        for scenario in bench.SCENARIOS:
            for n in bench.SMOKE_NODES:
                rows = [x for x in rounds if (x["handler"], x["scenario"], x["nodes"]) == (handler, scenario, n)]
                assert rows, (handler, scenario, n)
                for row in rows:
                    assert "error" not in row, row
                    missing = [f for f in bench.ROUND_FIELDS if f not in row]
                    assert not missing, (handler, scenario, n, missing)
                    assert row["ranks_complete"] and row["ops_total"] > 0 and row["bytes_total"] > 0
    for row in (x for x in rounds if x["handler"] in ("sentinel", "etcd") and x["scenario"] != "first_join"):
        # rank-preserving: the survivors keep their ranks, the spares take exactly the departed ones;
        # on etcd the bound is on the requests etcd served
        assert row["ranks_kept"] and row["spare_took_victim_ranks"], row
        assert row["survivor_ops_max"] <= 10, row
    figures = report["figures"]
    for n in bench.SMOKE_NODES:
        assert f"replacement_protocol_n{n}_seconds" in figures
        for handler in bench.HANDLERS:
            for scenario in bench.SCENARIOS:
                for unit in ("seconds", "survivor_ops_count", "total_ops_count", "cpu_seconds"):
                    assert f"{handler}_{scenario}_n{n}_{unit}" in figures
    for handler in bench.HANDLERS:
        for scenario in bench.SCENARIOS:
            assert f"{handler}_{scenario}_wall_exponent_ratio" in figures
            assert f"{handler}_{scenario}_total_ops_exponent_ratio" in figures
    assert "growth exponents" in stdout


def test_bad_arguments_are_refused_with_the_reason(tmp_path):
    r = subprocess.run([sys.executable, "bench/replacement_scale.py", "--nodes", "2"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--nodes must each be >= 3" in r.stderr
    bad = tmp_path / "runs.json"
    bad.write_text("not json")
    r = subprocess.run([sys.executable, "bench/replacement_scale.py", "--smoke", "--out", str(bad)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not this bench's JSON" in r.stderr
    assert bad.read_text() == "not json"  # nothing lost
