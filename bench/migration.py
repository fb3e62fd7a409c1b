"""Migration benchmark: repeated `sentinel drill` runs, interleaved so every path sees the same
machine noise; median and max of each stage, trip -> first step on the spare, lost steps.

Paths, side by side in one run:
  warm        Sentinel: predicted fault, migrate snapshot, warm spare (python -m trainer.elastic)
  warm-etcd   the same with torch's etcd-v2 rendezvous on a local etcd (--etcd; Debian etcd-server)
  one3        one victim of a 3-node job (2 warm spares): the baseline for two victims of the same job
  two         two victims at once (3 nodes, 2 warm spares): one membership change
  cold        the before: the same predicted migration with plain torchrun and a cold spare
  crash       plain torchrun crash failover: kill -9, no warning, cold spare, periodic snapshot

    python bench/migration.py [--runs 5] [--interval-steps 10] [--etcd] [--json PATH]

--json (bench/_report.py's shape; sentinel_tools/sim/measured.py reads it): medians over the drills
that succeeded. ``migration_*`` is the warm-spare path (``migration_trip_to_first_step_seconds``,
``migration_fault_to_first_step_seconds``, ``migration_lost_steps``, ``migration_ok_fraction``,
``migration_stage_<stage>_seconds`` = each stage's own duration), ``crash_*`` the plain torchrun
crash failover, and ``one_of_three_*``, ``two_victims_*``, ``etcd_migration_*``,
``cold_spare_torchrun_*`` the other paths, plus ``*_ratio`` figures (``two_victims_over_one_same_job_ratio``:
two victims / one victim of the same 3-node job; ``two_victims_over_one_ratio``: against the 2-node job).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

PATHS = {
    "warm": ("Sentinel, warm spare (c10d)", ["--fault", "xid79"]),
    "warm-etcd": ("Sentinel, warm spare (etcd-v2)", ["--fault", "xid79", "--rdzv-backend", "etcd-v2"]),
    "one3": ("Sentinel, 1 victim of 3 nodes", ["--fault", "xid79", "--nodes", "3", "--spares", "2", "--victims", "1"]),
    "two": ("Sentinel, 2 victims, 2 warm spares", ["--fault", "xid79", "--nodes", "3", "--spares", "2", "--victims", "2"]),
    "cold": ("before: torchrun, cold spare", ["--fault", "xid79", "--agent", "torchrun"]),
    "crash": ("plain torchrun crash failover", ["--fault", "kill", "--agent", "torchrun"]),
}
FIGURE_PREFIX = {"warm": "migration_", "warm-etcd": "etcd_migration_", "one3": "one_of_three_", "two": "two_victims_",
                 "cold": "cold_spare_torchrun_", "crash": "crash_"}


def drill(interval: int, extra: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--json", "--interval-steps", str(interval), *extra],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    if not r.stdout.strip().startswith("{"):
        return {"ok": False, "error": r.stderr[-500:]}
    return json.loads(r.stdout)


def median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def stage_durations(rows: list[dict]) -> dict[str, list[float]]:
    """Each stage's time since the trip (its own clock start), per run."""
    out: dict[str, list[float]] = {}
    for r in rows:
        trip = next((e["time"] for e in r["timeline"] if e["stage"] == "detected"), None)
        for e in r["timeline"]:
            if trip is not None and e["stage"] not in ("fault injected", "job finished"):
                out.setdefault(e["stage"], []).append(e["time"] - trip)
    return out


def slug(stage: str) -> str:
    return stage.replace(" ", "_").replace("-", "_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--interval-steps", type=int, default=10)
    ap.add_argument("--etcd", action="store_true", help="also the etcd-v2 rendezvous (needs etcd on PATH)")
    ap.add_argument("--only", help="comma-separated paths to run (default: all)")
    _report.add_json_argument(ap)
    args, extra = ap.parse_known_args()
    names = args.only.split(",") if args.only else [n for n in PATHS if n != "warm-etcd" or args.etcd]
    unknown = set(names) - set(PATHS)
    if unknown:
        ap.error(f"unknown path(s) {sorted(unknown)}; choose from {sorted(PATHS)}")
    rows: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.runs):  # interleaved, so every path sees the same machine noise
        for n in names:
            rows[n].append(drill(args.interval_steps, PATHS[n][1] + extra))
    load = os.getloadavg()
    print(f"host: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) at the end")

    figures: dict[str, float] = {}
    for n in names:
        ok = [r for r in rows[n] if r.get("ok")]
        print(f"\n{PATHS[n][0]}: {len(ok)}/{len(rows[n])} drills ok; seconds after the trip (median / max)")
        for r in rows[n]:
            if not r.get("ok") and r.get("error"):
                print(f"  failed: {r['error'][-200:]}")
        for stage, vals in stage_durations(ok).items():
            print(f"  {stage:<26} {median(vals):>7.2f} {max(vals):>7.2f}")
        if n == "warm":  # each stage's own duration, as the goodput simulator reads them
            own: dict[str, list[float]] = {}
            for r in ok:
                for e in r["timeline"]:
                    own.setdefault(e["stage"], []).append(e["duration"])
            for stage, vals in own.items():
                figures[f"migration_stage_{slug(stage)}_seconds"] = median(vals)
        if ok and ok[0]["timeline"] and any(e.get("phases") for e in ok[0]["timeline"]):
            phases: dict[str, list[float]] = {}
            for r in ok:
                for e in r["timeline"]:
                    for k, v in (e.get("phases") or {}).items():
                        phases.setdefault(k, []).append(v)
            print("  spare worker setup: " + ", ".join(f"{k} {median(v):.2f}" for k, v in phases.items()))
        trip = [r["trip_to_first_step_seconds"] for r in ok if r.get("trip_to_first_step_seconds") is not None]
        fault = [r["fault_to_first_step_seconds"] for r in ok if r.get("fault_to_first_step_seconds") is not None]
        lost = [len(r["recomputed_steps"]) for r in ok]
        p = FIGURE_PREFIX[n]
        if n != "crash":
            figures[f"{p}trip_to_first_step_seconds"] = median(trip)
        if n == "warm":  # the goodput simulator's migrate_warm_seconds (its migrate_seconds: the cold spare)
            figures["warm_spare_trip_to_first_step_seconds"] = median(trip)
        figures[f"{p}fault_to_first_step_seconds"] = median(fault)
        figures[f"{p}lost_steps"] = median(lost)
        figures[f"{p}ok_fraction"] = len(ok) / len(rows[n]) if rows[n] else None
        verified = [r for r in ok if "verify" in r]
        if verified:
            figures[f"{p}bitwise_equal_fraction"] = sum(bool(r["verify"]["bitwise_equal"]) for r in verified) / len(verified)

    def fmt(vals: list[float]) -> str:
        return f"{statistics.median(vals):.2f} / {max(vals):.2f}" if vals else "-"

    print(f"\n{'path':<38} {'ok':>5} {'fault->first step s':>20} {'trip->first step s':>19} {'recomputed':>11}"
          f" {'bitwise':>8}")
    for n in names:
        ok = [r for r in rows[n] if r.get("ok")]
        trip = [r["trip_to_first_step_seconds"] for r in ok if r.get("trip_to_first_step_seconds") is not None]
        fault = [r["fault_to_first_step_seconds"] for r in ok if r.get("fault_to_first_step_seconds") is not None]
        lost = [len(r["recomputed_steps"]) for r in ok]
        verified = [r for r in ok if "verify" in r]
        bitwise = f"{sum(r['verify']['bitwise_equal'] for r in verified)}/{len(verified)}" if verified else "-"
        print(f"{PATHS[n][0]:<38} {len(ok)}/{len(rows[n]):<3} {fmt(fault):>20} {fmt(trip) if n != 'crash' else '-':>19}"
              f" {fmt(lost):>11} {bitwise:>8}")
    base = figures.get("migration_trip_to_first_step_seconds")
    if base:
        print()
        for key, name, label in (
                ("two_victims_trip_to_first_step_seconds", "two_victims_over_one_ratio",
                 "two victims of 3 / one victim of 2 nodes"),
                ("cold_spare_torchrun_trip_to_first_step_seconds", "cold_torchrun_over_warm_ratio",
                 "before (torchrun, cold spare) / warm"),
                ("crash_fault_to_first_step_seconds", "plain_failover_over_warm_ratio",
                 "plain torchrun crash failover / warm"),
                ("etcd_migration_trip_to_first_step_seconds", "etcd_over_c10d_ratio", "etcd-v2 / c10d")):
            if figures.get(key):
                figures[name] = figures[key] / base
                print(f"{label:<38} {figures[name]:>6.2f}x")
    # the same 3-node job losing one node or two at once (the same processes on the same 2 cores):
    # what a second victim costs, without the bigger world's own cost on an oversubscribed host
    one3, two = figures.get("one_of_three_trip_to_first_step_seconds"), figures.get("two_victims_trip_to_first_step_seconds")
    if one3 and two:
        figures["two_victims_over_one_same_job_ratio"] = two / one3
        print(f"{'two victims / one victim, same 3-node job':<38} {two / one3:>6.2f}x")
    _report.write(args.json, "migration", figures)


if __name__ == "__main__":
    main()
