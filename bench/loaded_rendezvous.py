"""Two victims under load (#47 item 4): the two-victim drill — 3 nodes, 2 warm spares, both victims
fail at once (``--fault dbe``), ``--verify`` — repeated while ``--busy`` other CPU-bound processes
(``python -c 'while True: pass'``) load the host, for each rendezvous backend, interleaved so both
see the same load. Before #47 a round of torch's dynamic rendezvous could fail to complete for
minutes on a loaded host (docs/rendezvous.md, "A round under load").

    python bench/loaded_rendezvous.py [--runs 10] [--busy 2] [--backends c10d,sentinel] [--json PATH] [--append] [--smoke]

``--append`` adds this invocation's drills to those already in ``--json`` (a long series run in
several sittings: the figures are over every drill in the file). Each drill is appended to the
JSON as it finishes (bench/_report.py).

Figures (per backend ``<b>``: ``c10d``, ``sentinel``): ``loaded_two_victims_<b>_ok_fraction``
(drills that passed: the job finished on node0 and both spares, no step lost, bitwise equal to an
uninterrupted run), ``_drills_count``, ``_trip_to_first_step_seconds`` (median over the drills
that passed) and ``_max_trip_to_first_step_seconds``, ``_fault_to_first_step_seconds``,
``_max_lost_steps``; ``busy_processes_count``; ``loaded_two_victims_load_average_ratio`` (not a ratio: the median
1-minute load average at the end of each drill). Each drill's ``rendezvous stalled:`` lines (an
agent's round that made no progress for 10 s, the job's first start included) are kept in its
run and printed.

``--smoke``: one drill of the c10d backend, 12 steps, the fault at step 4, no busy process.
Arguments the bench does not know are passed to every drill, after its own (a later ``--steps``
wins). ``--reference-cache DIR`` keeps the uninterrupted runs ``--verify`` compares with in DIR
and reuses those already there (default: a temporary directory of this run).
Each drill's record keeps what its verdict is read from: its exit status, ``restore``,
``other_migrations`` and ``timeline`` beside the figures' keys (and its stderr's tail when it
failed); tests/test_drill.py's two-victim test runs this smoke and asserts on that record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

DRILL = ["--nodes", "3", "--spares", "2", "--victims", "2", "--fault", "dbe", "--verify"]
BACKENDS = ("c10d", "sentinel")
SMOKE_ARGS = ["--steps", "12", "--at-step", "4"]
SMOKE_FIGURES = ("loaded_two_victims_c10d_ok_fraction", "loaded_two_victims_c10d_drills_count",
                 "busy_processes_count", "loaded_two_victims_load_average_ratio")
STALL = "rendezvous stalled: "


def drill(backend: str, references: Path, timeout: float, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "sentinel", "drill", "--json", *DRILL, "--rdzv-backend", backend,
           "--reference-cache", str(references), "--timeout", str(timeout), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    stalls = [x.split("sentinel drill: ", 1)[-1] for x in r.stderr.splitlines() if STALL in x]
    if not r.stdout.strip().startswith("{"):
        return {"ok": False, "rc": r.returncode, "error": r.stderr[-1500:], "stalls": stalls}
    out = json.loads(r.stdout)
    keep = ("ok", "finished", "final_nodes", "recomputed_steps", "trip_to_first_step_seconds",
            "fault_to_first_step_seconds", "membership_changes", "verify", "notes", "restore", "other_migrations",
            "timeline")
    record = {**{k: out[k] for k in keep if k in out}, "rc": r.returncode,
              "stalls": stalls + out.get("rendezvous_stalls", [])}
    if not out.get("ok"):
        record["error"] = r.stderr[-1500:]
    return record


def summarise(runs: list[dict]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {}
    for b in BACKENDS:
        drills = [r["drill"] for r in runs if r["backend"] == b]
        if not drills:
            continue
        ok = [d for d in drills if d.get("ok") and d.get("verify", {}).get("bitwise_equal")]
        trip = [d["trip_to_first_step_seconds"] for d in ok if d.get("trip_to_first_step_seconds") is not None]
        fault = [d["fault_to_first_step_seconds"] for d in ok if d.get("fault_to_first_step_seconds") is not None]
        p = f"loaded_two_victims_{b}_"
        figures[p + "ok_fraction"] = len(ok) / len(drills)
        figures[p + "drills_count"] = len(drills)
        figures[p + "trip_to_first_step_seconds"] = statistics.median(trip) if trip else None
        figures[p + "max_trip_to_first_step_seconds"] = max(trip) if trip else None
        figures[p + "fault_to_first_step_seconds"] = statistics.median(fault) if fault else None
        figures[p + "max_lost_steps"] = max((len(d["recomputed_steps"]) for d in ok), default=None)
    figures["busy_processes_count"] = max((r.get("busy", 0) for r in runs), default=0)
    loads = [r["loadavg"][0] for r in runs if r.get("loadavg")]
    figures["loaded_two_victims_load_average_ratio"] = statistics.median(loads) if loads else None
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="drills per backend (default 10)")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the drills (default 2)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: c10d, sentinel")
    ap.add_argument("--timeout", type=float, default=300.0, help="each drill's --timeout (default 300 s)")
    ap.add_argument("--append", action="store_true", help="add to the drills already in --json")
    ap.add_argument("--reference-cache", type=Path, metavar="DIR",
                    help="keep and reuse the uninterrupted runs --verify compares with here (default: a temporary "
                         "directory of this run)")
    _report.add_json_argument(ap)
    args, extra = ap.parse_known_args()
    backends = args.backends.split(",")
    if set(backends) - set(BACKENDS):
        ap.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if args.smoke:
        args.runs, args.busy, backends, extra = 1, 0, ["c10d"], SMOKE_ARGS + extra
    results = _report.Results(args.json, "loaded_rendezvous", summarise)
    if args.append and args.json is not None and args.json.exists():
        results.runs = json.loads(args.json.read_text()).get("runs", [])
    signal.signal(signal.SIGTERM, lambda signum, _f: sys.exit(128 + signum))  # the busy processes go too
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="loaded-rdzv-refs-") as tmp:
            refs = args.reference_cache or Path(tmp)
            for i in range(args.runs):  # interleaved: both backends see the same load
                for b in backends:
                    d = drill(b, refs, args.timeout, extra)
                    results.add({"backend": b, "busy": args.busy, "drill": d})
                    print(f"{b:<9} drill {i + 1}/{args.runs}: {'ok' if d.get('ok') else 'FAILED'}"
                          f"  trip -> first step {d.get('trip_to_first_step_seconds') or float('nan'):.2f} s"
                          f"  load {os.getloadavg()[0]:.1f}" + "".join(f"\n  {s}" for s in d.get("stalls", [])), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    figures = summarise(results.runs)
    print(f"\nhost: {os.cpu_count()} CPUs, {args.busy} busy process(es); load average (median at each drill's end) "
          f"{figures.get('loaded_two_victims_load_average_ratio') or float('nan'):.1f}")
    print(f"{'backend':<9} {'passed':>8} {'trip->first step s (median / max)':>34}")
    for b in backends:
        p = f"loaded_two_victims_{b}_"
        if p + "drills_count" not in figures:
            continue
        n = int(figures[p + "drills_count"])
        med, top = figures.get(p + "trip_to_first_step_seconds"), figures.get(p + "max_trip_to_first_step_seconds")
        trip = f"{med:.2f} / {top:.2f}" if med is not None else "-"
        print(f"{b:<9} {round(figures[p + 'ok_fraction'] * n):>3}/{n:<4} {trip:>34}")
    results.finish()


if __name__ == "__main__":
    main()
