"""Regenerates docs/measured.json: runs every benchmark whose figures the goodput simulator takes
(each with ``--json``, each bounded in time), bundles their reports, records which simulator input
came from which figure and which are still assumptions, then prints the goodput tables of docs/benchmarks.md
(ETTR at 16,384 GPUs per strategy; what must hold for 0.97 / 0.95) and redraws
docs/ettr_vs_gpus.png from it.

    python bench/measure_all.py                     # run the benches, write docs/measured.json, print tables
    python bench/measure_all.py --tables-only       # only the tables and the plot, from docs/measured.json
    python bench/measure_all.py --include m.json    # also bundle reports measured elsewhere

A bench that is missing, fails or times out is left out and named in the bundle's ``notes``; the
inputs it would have given stay at their stated defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from sentinel_tools.sim import goodput, measured  # noqa: E402

OUT = REPO / "docs" / "measured.json"
PLOT = REPO / "docs" / "ettr_vs_gpus.png"
# (bench, its arguments, time limit s, needs root)
BENCHES = (
    ("snapshot_stall", ["--sizes-mb", "256", "1024", "--repeats", "5"], 900, False),
    ("migration", ["--runs", "3"], 1500, False),
    ("rendezvous_scale", ["--agents", "2", "4", "8", "16", "--repeats", "3"], 1200, False),  # feeds no input since issue 25
    # the restart's protocol term; torch's handler beside it stops at the N it cannot finish in 600 s
    ("replacement_scale", ["--nodes", "8", "16", "32", "64", "128", "256", "512", "1024", "2048"], 3600, False),
    ("ebpf_latency", ["--lines", "300"], 900, True),
    ("predict_eval", [], 300, False),
    ("memory_tier", [], 1200, False),  # issue 15's bench, once it exists
    ("poll_overhead", ["--seconds", "10", "--gpus", "8"], 600, False),
)


def run_benches(names: set[str] | None, work: Path) -> tuple[list[dict], list[str]]:
    reports, notes = [], []
    for name, argv, limit, root in BENCHES:
        if names is not None and name not in names:
            continue
        script = REPO / "bench" / f"{name}.py"
        if not script.exists():
            notes.append(f"{name}: not run (bench/{name}.py does not exist yet)")
            continue
        if root and os.geteuid() != 0:
            notes.append(f"{name}: not run (needs root)")
            continue
        out = work / f"{name}.json"
        print(f"== {name} {' '.join(argv)}", flush=True)
        try:
            r = subprocess.run([sys.executable, str(script), *argv, "--json", str(out)], cwd=REPO, timeout=limit,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            notes.append(f"{name}: not used (ran past its {limit} s limit)")
            continue
        print(r.stdout[-3000:], flush=True)
        if r.returncode != 0 or not out.exists():
            notes.append(f"{name}: not used (exit {r.returncode}{'' if out.exists() else ', no --json file'})")
            continue
        try:
            (rep,) = measured.load(out)
        except (measured.MeasuredError, ValueError) as exc:
            notes.append(f"{name}: not used ({exc})")
            continue
        reports.append(json.loads(out.read_text()))
        print(f"   {len(rep.figures)} figures; simulator inputs: {', '.join(measured.uses(rep)) or 'none'}")
    return reports, notes


def bundle(reports: list[dict], notes: list[str], where: dict[str, str]) -> dict:
    return {"kind": measured.BUNDLE_KIND, "version": measured.VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count()}, "reports": reports,
            "inputs": where, "notes": notes}


def tables(path: Path, runs: int, plot: bool) -> None:
    ap = argparse.ArgumentParser()
    goodput.add_arguments(ap)
    args = ap.parse_args(["--measured", str(path), "--runs", str(runs)])
    p, where, _ = goodput.params_from(args)
    print(goodput.provenance(p, where))
    res = goodput.run(p, runs=runs, seed=0, optimise=True, optimise_runs=20)
    print(f"\n| {p.gpus:,} GPUs, {p.days:g} days, Llama 3 failure mix | best interval | ETTR | p5 ETTR | lost GPU-hours |"
          f" memory-tier fallbacks |")
    print("|---|---|---|---|---|---|")
    for s in res.values():
        print(f"| {goodput.LABELS[s.strategy]} | {s.interval} | {s.ettr_mean:.3f} | {s.ettr_p5:.3f} | "
              f"{sum(s.lost_gpu_hours.values()) / 1e3:,.0f} k | {s.fallbacks_mean:.2f} |")
    rows = []
    for gpus, target in ((16384, 0.97), (100_000, 0.95)):
        e, reqs = goodput.sensitivity(replace(p, gpus=gpus), target, runs=20)
        rows.append((gpus, target, e, reqs))
    print()
    print(goodput.sensitivity_table(rows))
    if plot:
        goodput.plot(str(PLOT), p, runs=10, seed=0)
        print(f"\nplot: {PLOT}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=[b[0] for b in BENCHES],
                    help="run only these benches (none: only re-bundle --include files)")
    ap.add_argument("--include", nargs="+", default=[], metavar="FILE", help="also bundle these bench reports")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--tables-only", action="store_true", help="do not run benches: tables and plot from --out")
    ap.add_argument("--runs", type=int, default=100, help="Monte Carlo runs for the tables")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    if not args.tables_only:
        with tempfile.TemporaryDirectory(prefix="sentinel-measure-") as d:
            reports, notes = run_benches(set(args.only) if args.only is not None else None, Path(d))
        for path in args.include:
            try:
                rs = measured.load(path)
            except measured.MeasuredError as exc:
                sys.exit(f"measure_all: {exc}")
            doc = json.loads(Path(path).read_text())
            if doc.get("kind") == measured.BUNDLE_KIND:
                reports.extend(doc["reports"])
                notes.extend(doc.get("notes", []))
            else:
                reports.append(doc)
            print(f"included {path}: {', '.join(r.bench for r in rs)}")
        if not reports:
            sys.exit("measure_all: no bench gave a report; nothing written")
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(json.dumps(bundle(reports, notes, {}), indent=1) + "\n")
        try:
            ap2 = argparse.ArgumentParser()
            goodput.add_arguments(ap2)
            _, where, _ = goodput.params_from(ap2.parse_args(["--measured", str(tmp)]))
        except (measured.MeasuredError, ValueError) as exc:
            tmp.unlink()
            sys.exit(f"measure_all: the bundle is not usable: {exc}")
        where = {k: v.replace(str(tmp), args.out.name) for k, v in where.items()}
        tmp.write_text(json.dumps(bundle(reports, notes, where), indent=1) + "\n")
        os.replace(tmp, args.out)
        print(f"wrote {args.out}: {len(reports)} reports; " + "; ".join(notes))
    tables(args.out, args.runs, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
