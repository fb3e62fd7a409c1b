"""What correlated failures cost: every strategy on a 400-node, one-year fault trace, independent
faults vs the same faults plus bursts (a rack's power feed, a bad driver roll-out), side by side.

The traces are built here, so that bursts and independent faults can be told apart: the
independent part is drawn from the simulator's own Poisson model (Llama 3's rate and class mix),
and the bursts follow the published pattern of several nodes failing in the same minute. A real
trace replays the same way: ``sentinel simulate goodput --trace FILE`` (a published one, e.g.
stepfun-ai/InfiniteHBD-Trace, as it comes).

    python bench/goodput_trace.py [--nodes 400] [--days 365] [--gpus 2048] [--runs 20] [--json PATH] [--smoke]

``--smoke``: 64 nodes, 30 days, 2 replays.

Prints ETTR, double failures and breaker refusals per strategy for each trace and placement, the
CPU seconds one replay of all strategies takes (the < 10 s budget of issue #28), and what the
command costs on a year of a 400-node cluster given as published fault records (1,000 events,
reading + class table + every strategy with the interval search and the command's 200 replays:
the <= 2 CPU-s budget of issue #45), with the share of its faults the class table matched.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402
from sentinel_tools.sim import measured, trace  # noqa: E402
from sentinel_tools.sim.goodput import LABELS, STRATEGIES, Params  # noqa: E402


def with_bursts(events: list[dict], nodes: int, days: float, rng: random.Random) -> list[dict]:
    """The independent faults plus bursts: 6 rack power events (8 consecutive nodes, 24 h repair)
    and 2 bad driver roll-outs (10 % of the nodes at random, 4 h to roll back). A node already
    down at a burst's time is skipped (it cannot fail twice)."""
    horizon = days * 24.0
    bursts = [(rng.uniform(0, horizon - 48), list(range(r, r + 8)), "power_supply", 24.0)
              for r in rng.sample(range(0, nodes - 8, 8), 6)]
    bursts += [(rng.uniform(0, horizon - 48), rng.sample(range(nodes), nodes // 10), "driver roll-out", 4.0)
               for _ in range(2)]
    down: dict[str, list[tuple[float, float]]] = {}
    open_: dict[str, float] = {}
    for e in events:
        if e["event"] == "fault_start":
            open_[e["node"]] = e["time"]
        else:
            down.setdefault(e["node"], []).append((open_.pop(e["node"]), e["time"]))
    extra = []
    for at, members, cls, repair in bursts:
        for n in members:
            node = f"n{n:05d}"
            if any(a - repair <= at <= b for a, b in down.get(node, [])):
                continue
            down.setdefault(node, []).append((at, at + repair))
            extra += [{"node": node, "time": at, "event": "fault_start", "class": cls},
                      {"node": node, "time": at + repair, "event": "fault_end", "class": cls}]
    return sorted(events + extra, key=lambda e: (e["time"], e["node"], e["event"] == "fault_end"))


SMOKE_FIGURES = tuple(f"trace_{t}_{p}_{s}_ettr_fraction" for t in ("independent", "bursts")
                      for p in ("cross_domain", "adjacent") for s in STRATEGIES) + tuple(
    f"trace_{t}_{p}_replay_cpu_seconds" for t in ("independent", "bursts") for p in ("cross_domain", "adjacent")) + (
    "trace_records_command_cpu_seconds", "trace_records_events_count", "trace_records_matched_fraction")


def published_records(p: Params, nodes: int, days: float, events: int, runs: int, seed: int, tmp: str) -> dict:
    """A trace of about ``events`` events on ``nodes`` nodes over ``days``, written as published
    fault records, read and replayed as ``sentinel simulate goodput --trace`` does (CPU seconds)."""
    rate = events / 2 / nodes / days
    drawn = trace.synthetic_events(replace(p, gpus=nodes * 8, days=days, rate_per_node_day=rate), nodes,
                                   random.Random(seed))
    path = Path(tmp) / "records.json"
    path.write_text(json.dumps(trace.as_fault_records(drawn), indent=4))
    cpu = time.process_time()
    classes = trace.load_classes()
    tr = trace.load_trace(str(path), nodes=nodes)
    trace.replay(tr, p, classes, runs=runs, seed=seed, optimise=True)
    cpu = time.process_time() - cpu
    share = trace.match_share(tr, classes)
    return {"trace_records_command_cpu_seconds": cpu, "trace_records_events_count": len(tr.events),
            "trace_records_matched_fraction": 1 - share[""] / max(1, len(tr.faults))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=400)
    ap.add_argument("--days", type=float, default=365.0)
    ap.add_argument("--gpus", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measured", default=str(Path(__file__).resolve().parents[1] / "docs" / "measured.json"))
    _report.add_json_argument(ap)
    a = ap.parse_args(argv)
    if a.smoke:
        a.nodes, a.days, a.gpus, a.runs = 64, 30.0, 128, 2
    defaults = {f: getattr(Params(), f) for f in Params.__dataclass_fields__}
    values, _ = measured.resolve(measured.load_all([a.measured]), {}, defaults, a.gpus // 8)
    p = Params(gpus=a.gpus, days=a.days, **values)
    rng = random.Random(a.seed)
    independent = trace.synthetic_events(replace(p, gpus=a.nodes * 8), a.nodes, rng)
    bursty = with_bursts(independent, a.nodes, a.days, rng)
    classes = trace.load_classes()
    figures: dict[str, float] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, events in (("independent", independent), ("bursts", bursty)):
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps({"time_unit": "hours", "duration": a.days * 24,
                                        "nodes": [f"n{i:05d}" for i in range(a.nodes)], "events": events}))
            tr = trace.load_trace(str(path))
            for placement in ("cross_domain", "adjacent"):
                q = replace(p, placement=placement, domain_nodes=8)
                cpu, wall = time.process_time(), time.perf_counter()
                _, lay, res = trace.replay(tr, q, classes, runs=a.runs, seed=a.seed, optimise=True)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                rows.append((name, placement, lay, res, cpu, wall))
                for s, r in res.items():
                    figures[f"trace_{name}_{placement}_{s}_ettr_fraction"] = r.ettr_mean
                    figures[f"trace_{name}_{placement}_{s}_double_failures_count"] = r.double_failures
                figures[f"trace_{name}_{placement}_replay_cpu_seconds"] = cpu
        figures.update(published_records(p, a.nodes, a.days, 1000 if not a.smoke else 100, 200 if not a.smoke else 5,
                                         a.seed, tmp))
    print(f"{a.nodes} nodes, {a.days:g} days, job {a.gpus:,} GPUs, {a.runs} replays each (prediction draws), "
          f"inputs {a.measured}")
    print(f"{'trace':<12} {'replica':<13} {'strategy':<44} {'ETTR':>7} {'hand-overs':>11} {'double fail':>12} "
          f"{'breaker ref':>12}")
    for name, placement, lay, res, cpu, wall in rows:
        for s in STRATEGIES:
            r = res[s]
            print(f"{name:<12} {placement:<13} {LABELS[s]:<44} {r.ettr_mean:>7.4f} {r.migrations:>11.1f} "
                  f"{r.double_failures:>12.2f} {r.breaker_refusals:>12.2f}")
        print(f"{'':<12} {'':<13} job faults {len(lay.failures)}, waited for a repaired node {lay.waits}; "
              f"replay of all strategies: {cpu:.2f} s CPU, {wall:.2f} s wall")
    for s in STRATEGIES:
        ind = figures[f"trace_independent_cross_domain_{s}_ettr_fraction"]
        bur = figures[f"trace_bursts_cross_domain_{s}_ettr_fraction"]
        figures[f"trace_bursts_over_independent_{s}_lost_ratio"] = (1 - bur) / (1 - ind) if ind < 1 else float("nan")
    print("lost time, bursts / independent (cross-domain replicas): " + ", ".join(
        f"{s} {figures[f'trace_bursts_over_independent_{s}_lost_ratio']:.2f}x" for s in STRATEGIES))
    print(f"published fault records, {figures['trace_records_events_count']:,} events on {a.nodes} nodes over "
          f"{a.days:g} days: read + class table + every strategy ({200 if not a.smoke else 5} replays, interval search) "
          f"{figures['trace_records_command_cpu_seconds']:.2f} s CPU; class table matched "
          f"{100 * figures['trace_records_matched_fraction']:.1f} % of the faults")
    _report.write(a.json, "goodput_trace", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
