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
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))
LIMIT_S = 600  # a smoke run is seconds on a quiet machine; this only bounds a hung one


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
    assert {"ebpf_latency", "migration", "snapshot_stall", "measure_all"} <= set(BENCHES)


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
    assert len(doc["host"]["loadavg"]) == 3 and doc["host"]["commit"]
    got = doc["figures"]
    missing = [f for f in figures if f not in got]
    assert not missing, f"bench/{name}.py --smoke did not write {missing}"
    bad = {f: got[f] for f in figures if not (isinstance(got[f], (int, float)) and math.isfinite(got[f]))}
    assert not bad, f"bench/{name}.py wrote non-finite figures {bad}"
    # the simulator's reader takes every bench's report as it is
    from sentinel_tools.sim import measured
    assert measured.load(out)[0].bench == name
