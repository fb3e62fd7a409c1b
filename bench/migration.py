"""Migration benchmark: repeated `sentinel drill` runs; median and max of each stage, trip -> first
step on the spare, lost steps; side by side with a plain crash (kill -9, no warning) restarted on
the spare from a periodic snapshot every M steps.

    python bench/migration.py [--runs 5] [--interval-steps 10] [--json PATH]

``--json`` figures (medians over the drills that succeeded): ``migration_trip_to_first_step_seconds``,
``migration_fault_to_first_step_seconds``, ``migration_stage_<stage>_seconds`` per timeline stage,
``migration_lost_steps``, and for the plain crash ``crash_fault_to_first_step_seconds`` and
``crash_lost_steps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402


def drill(fault: str, interval: int, extra: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--json", "--fault", fault,
                        "--interval-steps", str(interval), *extra], capture_output=True, text=True, timeout=600, cwd=REPO)
    if not r.stdout.strip().startswith("{"):
        return {"ok": False, "error": r.stderr[-500:]}
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--interval-steps", type=int, default=10)
    ap.add_argument("--fault", default="xid79")
    _report.add_json_argument(ap)
    args, extra = ap.parse_known_args()
    planned, crashed = [], []
    for _ in range(args.runs):  # interleaved, so both see the same machine noise
        planned.append(drill(args.fault, args.interval_steps, extra))
        crashed.append(drill("kill", args.interval_steps, extra))
    ok = [r for r in planned if r.get("ok")]
    print(f"planned migration ({args.fault}): {len(ok)}/{len(planned)} drills ok")
    durations: dict[str, list[float]] = {}
    for r in ok:
        for e in r["timeline"]:
            durations.setdefault(e["stage"], []).append(e["duration"])
    print(f"{'stage':<26} {'median s':>9} {'max s':>8}")
    for stage, vals in durations.items():
        print(f"{stage:<26} {statistics.median(vals):>9.2f} {max(vals):>8.2f}")

    def summary(rows: list[dict], key: str) -> str:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return f"{statistics.median(vals):.2f} / {max(vals):.2f}" if vals else "-"

    def lost(rows: list[dict]) -> str:
        vals = [len(r["recomputed_steps"]) for r in rows if "recomputed_steps" in r]
        return f"{statistics.median(vals):g} / {max(vals)}" if vals else "-"

    print()
    print(f"{'path':<38} {'ok':>5} {'fault->first step s (med/max)':>30} {'trip->first step s':>20} {'recomputed steps (med/max)':>27}")
    ok_c = [r for r in crashed if r.get("ok")]
    print(f"{'Sentinel: predicted, snapshot + spare':<38} {len(ok)}/{len(planned):<3} {summary(ok, 'fault_to_first_step_seconds'):>30} "
          f"{summary(ok, 'trip_to_first_step_seconds'):>20} {lost(ok):>27}")
    print(f"{'plain crash, periodic every %d steps' % args.interval_steps:<38} {len(ok_c)}/{len(crashed):<3} "
          f"{summary(ok_c, 'fault_to_first_step_seconds'):>30} {'-':>20} {lost(ok_c):>27}")

    def median_of(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    figures = {
        "migration_trip_to_first_step_seconds": median_of(ok, "trip_to_first_step_seconds"),
        "migration_fault_to_first_step_seconds": median_of(ok, "fault_to_first_step_seconds"),
        "migration_lost_steps": statistics.median([len(r["recomputed_steps"]) for r in ok]) if ok else None,
        "migration_ok_fraction": len(ok) / len(planned) if planned else None,
        "crash_fault_to_first_step_seconds": median_of(ok_c, "fault_to_first_step_seconds"),
        "crash_lost_steps": statistics.median([len(r["recomputed_steps"]) for r in ok_c]) if ok_c else None,
        "crash_ok_fraction": len(ok_c) / len(crashed) if crashed else None,
    }
    for stage, vals in durations.items():
        figures[f"migration_stage_{stage.replace(' ', '_').replace('-', '_')}_seconds"] = statistics.median(vals)
    _report.write(args.json, "migration", figures)


if __name__ == "__main__":
    main()
