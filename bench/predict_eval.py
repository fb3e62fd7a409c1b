"""Replays the whole scenario corpus through the policy and prints recall, false migrations and
lead times. Targets: every degrading scenario predicted with >= 5 minutes lead; zero migrations
for application-only and healthy scenarios.

    python bench/predict_eval.py [--lead-time 600] [--json PATH]

``--json`` figures: ``degrading_recall_fraction`` (>= 5 min lead), ``sudden_caught_fraction``,
``benign_false_migration_fraction``, ``degrading_lead_median_seconds``, ``scenarios_count``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from sentinel_tools import scenarios  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "scenarios"
# --smoke replays the same corpus (it takes seconds): every figure is a count over all of it
SMOKE_FIGURES = ("degrading_recall_fraction", "sudden_caught_fraction", "benign_false_migration_fraction",
                 "degrading_lead_median_seconds", "scenarios_count")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lead-time", type=float, default=None, help="override policy.lead_time_seconds")
    _report.add_json_argument(ap)
    args = ap.parse_args()
    rows = []
    for sc in scenarios.corpus(CORPUS):
        cfg = scenarios.config_for(sc)
        if args.lead_time:
            cfg = dataclasses.replace(cfg, lead_time_seconds=args.lead_time)
        t0 = time.perf_counter()
        r = scenarios.replay(sc, cfg)
        elapsed = time.perf_counter() - t0
        first = next((trip for _, trip in r.trips if trip.action == "migrate"), None)
        rows.append((sc, r, first, elapsed))
    print(f"{'scenario':<20} {'kind':<10} {'polls':>6} {'first migrate':>14} {'by rule':<16} {'lead s':>7} {'trips':>6} {'replay ms':>9}")
    for sc, r, first, elapsed in rows:
        polls = int(sc["duration_seconds"] // sc["poll_seconds"]) + 1
        fm = "-" if r.first_migrate is None else f"{r.first_migrate:g}"
        lead = "-" if r.lead_seconds is None else f"{r.lead_seconds:g}"
        print(f"{sc['name']:<20} {sc['kind']:<10} {polls:>6} {fm:>14} {first.rule if first else '-':<16} {lead:>7} "
              f"{len(r.trips):>6} {elapsed * 1000:>9.0f}")
    degrading = [(sc, r) for sc, r, _, _ in rows if sc["kind"] == "degrading"]
    sudden = [(sc, r) for sc, r, _, _ in rows if sc["kind"] == "sudden"]
    benign = [(sc, r) for sc, r, _, _ in rows if sc["kind"] == "benign"]
    predicted = [r for _, r in degrading if r.lead_seconds is not None and r.lead_seconds >= 300]
    caught = [r for sc, r in sudden if r.first_migrate is not None]
    false = [r for _, r in benign if r.first_migrate is not None]
    leads = [r.lead_seconds for _, r in degrading if r.lead_seconds is not None]
    print()
    print(f"recall (degrading, >= 5 min lead): {len(predicted)}/{len(degrading)}")
    print(f"sudden failures caught:            {len(caught)}/{len(sudden)}")
    print(f"false migrations (benign):         {len(false)}/{len(benign)}")
    print(f"median lead time (degrading):      {statistics.median(leads):.0f} s" if leads else "median lead time: -")
    _report.write(args.json, "predict_eval", {
        "degrading_recall_fraction": len(predicted) / len(degrading) if degrading else None,
        "sudden_caught_fraction": len(caught) / len(sudden) if sudden else None,
        "benign_false_migration_fraction": len(false) / len(benign) if benign else None,
        "degrading_lead_median_seconds": statistics.median(leads) if leads else None,
        "scenarios_count": len(rows),
    })


if __name__ == "__main__":
    main()
