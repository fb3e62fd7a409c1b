"""Running one bench's ``--smoke`` in a test: the figures it promises (its module-level
``SMOKE_FIGURES``), each finite, in a ``--json`` report with its provenance, under a tmp path.

tests/test_bench_smoke.py runs every bench through here; a bench whose smoke needs more checks
than these runs in a test of its own (``OWN_TEST``), which calls :func:`run_smoke` too, so that
each bench's smoke runs once in the suite.
"""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# measure_all drives the others (tests/test_benchmarks_doc.py covers it); every other script is a bench
DRIVERS = {"measure_all"}
BENCHES = sorted(p.stem for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_") and p.stem not in DRIVERS)
# benches whose smoke runs in another test (which checks what run_smoke checks, and more): test file, test name
OWN_TEST = {
    "migration": ("tests/test_bench_smoke.py", "test_migration_killed_mid_run_keeps_the_finished_drills"),
    "loaded_rendezvous": ("tests/test_drill.py", "test_two_nodes_fail_at_once"),  # its one drill is that test's
    "peers": ("tests/test_peers_bench.py", "test_smoke_kills_node1_at_the_same_step_for_sentinel_and_torch_elastic"),
    "replacement_scale": ("tests/test_replacement_scale.py", "test_smoke_produces_every_promised_figure_for_both_handlers"),
}
# benches that share the host's kernel log: their smoke runs in conftest's "kernel" xdist group (one
# at a time with the tests that write kernel lines), like every test whose daemon reads or writes it
KERNEL_LOG = {"ebpf_latency": "writes Xid lines into /dev/kmsg and its daemon reads them",
              "poll_overhead": "its `sentinel run --simulate` daemon reads the host's kernel log (/dev/kmsg)",
              "nvml_device_check": "its `sentinel run` daemon reads the host's kernel log (/dev/kmsg)"}
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


def command(name: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", *extra, "--json", str(out)]


def check_report(name: str, out: Path, cmd: list[str]) -> dict:
    """``out`` holds every promised figure, finite, with the load average, the commit and ``cmd``."""
    figures = promised(name)
    assert figures, f"bench/{name}.py promises no figures"
    doc = json.loads(out.read_text())
    assert doc["bench"] == name
    assert doc["host"]["command"][1:] == cmd[1:]
    assert len(doc["host"]["loadavg"]) == 3 and "commit" in doc["host"]
    got = doc["figures"]
    missing = [f for f in figures if f not in got]
    assert not missing, f"bench/{name}.py --smoke did not write {missing}"
    bad = {f: got[f] for f in figures if not (isinstance(got[f], (int, float)) and math.isfinite(got[f]))}
    assert not bad, f"bench/{name}.py wrote non-finite figures {bad}"
    # the simulator's reader takes every bench's report as it is
    from sentinel_tools.sim import measured
    assert measured.load(out)[0].bench == name
    return doc


def run_smoke(name: str, tmp_path: Path, *extra: str) -> tuple[dict, str]:
    """``bench/<name>.py --smoke [extra] --json <tmp>``, run from ``tmp_path``: its report, checked,
    and its stdout. The report never goes to docs/measured.json."""
    out = tmp_path / f"{name}.json"
    cmd = command(name, out, *extra)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"bench/{name}.py --smoke failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return check_report(name, out, cmd), r.stdout
