"""docs/benchmarks.md's tables are generated from docs/measured.json by bench/measure_all.py: a
figure typed into the generated block that disagrees with the JSON fails here, as does a block
that was not regenerated after the JSON changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import measure_all  # noqa: E402


def test_docs_block_is_what_the_json_generates():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.count(measure_all.BEGIN) == 1 and text.count(measure_all.END) == 1
    have = text.split(measure_all.BEGIN, 1)[1].split(measure_all.END, 1)[0]
    want = measure_all.generated_block(json.loads((REPO / "docs" / "measured.json").read_text()))
    want = want.split(measure_all.BEGIN, 1)[1].split(measure_all.END, 1)[0]
    bad = [f"docs: {h!r}\n json: {w!r}" for h, w in zip(have.splitlines(), want.splitlines()) if h != w]
    assert not bad and len(have.splitlines()) == len(want.splitlines()), (
        "docs/benchmarks.md disagrees with docs/measured.json (run `python bench/measure_all.py --docs-only`):\n"
        + "\n".join(bad[:10]))


def test_every_figure_is_in_the_docs_with_its_condition():
    doc = json.loads((REPO / "docs" / "measured.json").read_text())
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for rep in doc["reports"]:
        for name, value in rep["figures"].items():
            row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
            assert row is not None, f"{rep['bench']}.{name} is not in docs/benchmarks.md"
            assert measure_all.fmt(name, value) in row
            if name.endswith("_ratio"):  # a ratio names its numerator and denominator (or says it is none)
                said = row.rsplit("|", 2)[-2]
                assert " / " in said or said.strip().startswith("not a ratio:"), row


def test_a_typed_figure_that_disagrees_is_caught(tmp_path: Path):
    bundle = json.loads((REPO / "docs" / "measured.json").read_text())
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nprose a person wrote\n\n" + measure_all.generated_block(bundle) + "\n\nmore prose\n")
    mig = next(r for r in bundle["reports"] if r["bench"] == "migration")
    right = measure_all.fmt("plain_failover_over_warm_ratio", mig["figures"]["plain_failover_over_warm_ratio"])
    edited = doc.read_text().replace(f"| {right} |", "| 5.82x |")
    assert edited != doc.read_text()
    # the regenerated document restores the JSON's figure and keeps the prose around the block
    fixed = measure_all.render_doc(edited, measure_all.generated_block(bundle))
    assert "| 5.82x |" not in fixed and f"| {right} |" in fixed
    assert fixed.startswith("# Benchmarks\n\nprose a person wrote\n") and fixed.endswith("\n\nmore prose\n")


def test_docs_only_regenerates_from_the_given_bundle(tmp_path: Path):
    bundle = json.loads((REPO / "docs" / "measured.json").read_text())
    bundle["reports"][0]["figures"] = {"made_up_seconds": 1.5}
    src = tmp_path / "measured.json"
    src.write_text(json.dumps(bundle))
    measure_all.write_doc(src, tmp_path / "benchmarks.md")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "| `made_up_seconds` |" in text and measure_all.BEGIN in text and measure_all.END in text
    r = subprocess.run([sys.executable, str(REPO / "bench" / "measure_all.py"), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0 and "--loaded" in r.stdout


def test_smoke_and_trial_runs_never_write_docs(tmp_path: Path):
    """``measure_all --smoke`` (and any --out but docs/measured.json) writes its bundle, page and
    plot to a temporary directory: docs/ stays as committed. Bundling an existing report (--only
    with no bench) regenerates the page there from docs/benchmarks.md's prose."""
    before = {p: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "measure_all.py"), "--smoke", "--only", "--include",
                        str(REPO / "docs" / "measured.json"), "--no-plot"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (out,) = tmp_path.glob("sentinel-measure-smoke-*/measured.json")
    assert f"wrote {out}:" in r.stdout
    page = (out.with_name("benchmarks.md")).read_text()
    assert page.count(measure_all.BEGIN) == 1 and page.startswith((REPO / "docs" / "benchmarks.md").read_text().split(measure_all.BEGIN)[0])
    assert {p: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()} == before
    refused = subprocess.run([sys.executable, str(REPO / "bench" / "measure_all.py"), "--smoke", "--doc",
                              str(REPO / "docs" / "benchmarks.md")], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={**os.environ, "TMPDIR": str(tmp_path / "refused")})
    assert refused.returncode == 2 and "never writes docs/" in refused.stderr
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())  # nothing made first


def test_quiet_is_what_the_load_average_says():
    """A run without the background job is quiet only when the host was: a load average above the
    CPU count (other work on a shared host) labels it busy; beside the job it is loaded."""
    def host(load: float) -> dict:
        return {"host": {"cpus": 2, "loadavg": [load, load, load]}}
    assert measure_all.label(host(1.5), "quiet") == "quiet"
    assert measure_all.label(host(9.6), "quiet") == "busy"
    assert measure_all.label(host(0.1), "loaded") == "loaded"


def test_no_table_is_typed_outside_the_generated_block():
    """The page's tables are the generated ones: a table typed into the prose (as the daemon-overhead,
    stall and migration tables once were) goes stale against the JSON unnoticed."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    head, rest = text.split(measure_all.BEGIN, 1)
    tail = rest.split(measure_all.END, 1)[1]
    typed = [line for line in (head + tail).splitlines() if line.lstrip().startswith("|")]
    assert not typed, f"docs/benchmarks.md types tables outside the generated block: {typed[:3]}"


def test_busy_and_loaded_runs_of_one_bench_sit_side_by_side():
    """measure_all --loaded on a busy host: the run beside the background job and the one beside
    other work are both in the page, in columns of their own."""
    def rep(load: float, condition: str, v: float) -> dict:
        return {"bench": "example", "figures": {"example_seconds": v},
                "host": {"cpus": 2, "loadavg": [load, load, load], "condition": condition}}
    block = measure_all.generated_block({"reports": [rep(9.0, "loaded", 2.5), rep(5.0, "busy", 1.25)]})
    row = next(line for line in block.splitlines() if line.startswith("| `example_seconds` |"))
    header = next(line for line in block.splitlines() if line.startswith("| figure |"))
    assert header == "| figure | quiet | busy | loaded | ratio of |"
    assert row.startswith("| `example_seconds` | not measured | 1.25 | 2.5 |")

