"""Replaying a node fault trace through every strategy (``sentinel simulate goodput --trace FILE``).

The Poisson path (``goodput.draw_failures``) draws independent failures with a fixed class mix.
Real clusters fail in bursts (a switch, a power feed, a bad roll-out) with long and short repairs
and many faults of no hardware class; this module replays such a history instead. What a trace
and the class table say, and how they are checked, is ``trace_input``'s (the formats are there).

Classes map to what Sentinel would see and do (``trace_classes.toml``, overridable): predicted
with a lead time, a sudden node loss, a process crash the node survives, or no interruption; a
fault is matched on its description first, then its class.

Trace -> job: the job's nodes are the first ``G / gpus_per_node`` trace nodes in natural order of
their ids (racks usually number consecutively, so ``adjacent`` replica placement is what it says);
the other nodes are the spare pool. A node is unavailable while any of its faults is open. A job
node's fault (other than ``process`` / ``none``) takes the spare free longest; the failed node
joins the pool once all its open faults have ended. When the job needs more nodes than the trace
has, the trace is repeated over disjoint copies of its nodes, copy k shifted by k/copies of its
duration (wrapping around), and the output says so. Two replica partners down at once is then
simply what happens when the trace has them fail together.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field, replace

from sentinel_tools.sim.goodput import (LABELS, STRATEGIES, Failure, Outcome, Params, interval_text, optimise_interval,
                                        simulate)
from sentinel_tools.sim.trace_input import (FORMATS, UNITS, ClassTable, Fault, Trace, TraceError, check, load_classes,
                                            load_trace, natural_key)

__all__ = ["FORMATS", "UNITS", "ClassTable", "Fault", "Trace", "TraceError", "check", "load_classes", "load_trace",
           "layout", "replay", "header", "table", "main", "synthetic_events"]


# -- trace -> the job's failures ---------------------------------------------------------------------
@dataclass(frozen=True)
class JobFault:
    """A fault of a node that was in the job when it began."""

    fault: Fault
    slot: int
    kind: str  # the class table's: predicted, sudden or process
    ready: float  # when the node that replaces it is free (hours; inf: never)
    cause: str  # the class table's entry, or the trace's own label when no entry matched
    predictable: float  # the entry's share seen ahead (0 unless kind is predicted)


@dataclass
class Layout:
    """How the job sits on the trace: its nodes, the spare pool, the copies."""

    copies: int
    job_nodes: int
    spare_nodes: int
    trace_nodes: int
    duration: float
    failures: list[JobFault] = field(default_factory=list)
    unknown: dict[str, int] = field(default_factory=dict)
    not_interruptions: int = 0
    spare_faults: int = 0  # faults of nodes that were spares (or already out of the job) at the time
    waits: int = 0  # job faults that waited for a repaired node


def _copies(trace: Trace, copies: int) -> list[Fault]:
    """The faults of ``copies`` disjoint copies of the trace's nodes (``<node>#<k>``), copy k
    shifted by k/copies of the trace's duration and wrapped around; a fault cut by the wrap ends at
    the end of the trace and starts again at 0. Sorted by start (stable: copy by copy)."""
    if copies == 1:
        return list(trace.faults)
    d = trace.duration
    out: list[Fault] = []
    for k in range(copies):
        shift = d * k / copies
        for f in trace.faults:
            node, start, end = f"{f.node}#{k}", f.time + shift, f.end + shift
            if start >= d:
                out.append(replace(f, node=node, time=start - d, end=end - d))
            elif end > d:
                out.append(replace(f, node=node, time=start, end=d))
                out.append(replace(f, node=node, time=0.0, end=end - d))
            else:
                out.append(replace(f, node=node, time=start, end=end))
    out.sort(key=lambda f: f.time)
    return out


def back_up(faults: list[Fault]) -> list[float]:
    """For each fault, when its node is up again: the end of the run of overlapping (or touching)
    faults it belongs to, since a node is down while any of its faults is open."""
    up = [0.0] * len(faults)
    by_node: dict[str, list[int]] = {}
    for i, f in enumerate(faults):
        by_node.setdefault(f.node, []).append(i)
    for idx in by_node.values():
        idx.sort(key=lambda i: faults[i].time)
        run: list[int] = []
        end = -math.inf
        for i in idx + [-1]:
            if i < 0 or faults[i].time > end:
                for j in run:
                    up[j] = end
                run, end = [], -math.inf
            if i >= 0:
                run.append(i)
                end = max(end, faults[i].end)
    return up


def layout(trace: Trace, p: Params, classes: ClassTable, extra_spares: int = 0) -> Layout:
    """The job's failures on the trace's nodes (strategy-independent): which slot each job fault
    hits, its kind, and when its replacement is free."""
    n_trace = len(trace.nodes)
    copies = max(1, math.ceil(p.nodes / n_trace))
    timed = _copies(trace, copies)
    up = back_up(timed)
    # copy by copy, so copy 0 fills the first slots
    names = trace.nodes if copies == 1 else [f"{n}#{k}" for k in range(copies) for n in trace.nodes]
    names += [f"spare-{i}" for i in range(extra_spares)]
    job = {n: i for i, n in enumerate(names[:p.nodes])}
    pool: dict[str, float] = {n: 0.0 for n in names[p.nodes:]}  # spare -> free since
    down_until: dict[str, float] = {}
    lay = Layout(copies, p.nodes, len(pool), n_trace, trace.duration)
    for f, until in zip(timed, up):
        t = f.time
        down_until[f.node] = max(down_until.get(f.node, 0.0), until)
        rule = classes.lookup(f.cls, f.description)
        kind = rule.kind if rule else "sudden"
        if rule is None:
            lay.unknown[f.label] = lay.unknown.get(f.label, 0) + 1
        if f.node not in job:
            lay.spare_faults += 1
            continue
        if kind == "none":
            lay.not_interruptions += 1
            continue
        slot = job[f.node]
        ready = t
        if kind != "process":
            free = {n: max(since, down_until.get(n, 0.0)) for n, since in pool.items()}
            if free:
                spare = min(free, key=lambda n: (max(free[n], t), pool[n], natural_key(n)))
                ready = free[spare]  # when it is free (a migration may take it before the fault)
                del pool[spare]
                job[spare] = slot
            else:
                ready = math.inf
            lay.waits += ready > t
            del job[f.node]
            pool[f.node] = down_until[f.node]  # back in the pool once all its faults have ended
        lay.failures.append(JobFault(f, slot, kind, ready, rule.name if rule else f.label,
                                     rule.predictable if rule and kind == "predicted" else 0.0))
    return lay


def failures_for(lay: Layout, p: Params, rng: random.Random) -> list[Failure]:
    """One replay's failures: the predicted share and lead times drawn (per replay) with ``rng``."""
    out = []
    horizon = lay.duration
    for jf in lay.failures:
        pred = rng.random() < jf.predictable
        lead = rng.expovariate(1.0 / p.lead_mean_hours) if p.lead_mean_hours > 0 else 0.0
        out.append(Failure(jf.fault.time, jf.cause, pred, lead, jf.slot,
                           kind="process" if jf.kind == "process" else "sudden", spare_ready=min(jf.ready, horizon)))
    return out


# -- every strategy on the same trace ----------------------------------------------------------------
@dataclass
class TraceSummary:
    strategy: str
    interval: str
    ettr_mean: float
    ettr_p5: float
    lost_gpu_hours: dict[str, float]
    migrations: float
    double_failures: float
    breaker_refusals: float
    waited_for_spare: float


def replay(trace: Trace, p: Params, classes: ClassTable, runs: int = 20, seed: int = 0,
           strategies: tuple[str, ...] = STRATEGIES, optimise: bool = False, extra_spares: int = 0
           ) -> tuple[Params, Layout, dict[str, TraceSummary]]:
    """Every strategy over the same trace, ``runs`` times (each run draws which predicted faults
    Sentinel sees and their lead times; the faults themselves are the trace's)."""
    lay = layout(trace, p, classes, extra_spares)
    q = replace(p, days=trace.duration / 24.0, breaker_nodes=lay.job_nodes + lay.spare_nodes)
    rng = random.Random(seed)
    draws = [failures_for(lay, q, rng) for _ in range(runs)]
    out = {}
    for s in strategies:
        best = optimise_interval(q, s, draws[:min(runs, 10)]) if optimise else q
        outs: list[Outcome] = [simulate(best, s, d) for d in draws]
        lost: dict[str, float] = {}
        for o in outs:
            for k, v in o.lost_gpu_hours.items():
                lost[k] = lost.get(k, 0.0) + v / runs
        ettrs = sorted(o.ettr for o in outs)
        out[s] = TraceSummary(s, interval_text(best, s), statistics.fmean(ettrs), ettrs[int(0.05 * runs)], lost,
                              statistics.fmean(o.migrations for o in outs), statistics.fmean(o.fallbacks for o in outs),
                              statistics.fmean(o.breaker_refusals for o in outs),
                              sum(o.waited_for_spare for o in outs) / runs)
    return q, lay, out


def match_share(trace: Trace, classes: ClassTable) -> dict[str, int]:
    """How the trace's faults met the class table: on the description, on the class, only a
    fallback entry (the trace names no cause), or nothing (replayed as sudden)."""
    out = {"description": 0, "class": 0, "fallback": 0, "": 0}
    for f in trace.faults:
        out[classes.match(f.cls, f.description).on] += 1
    return out


def header(trace: Trace, lay: Layout, p: Params, classes: ClassTable) -> str:
    n = len(trace.faults)
    lines = [f"trace {trace.path} ({trace.format}): {lay.trace_nodes:,} nodes, {n:,} faults over "
             f"{trace.duration / 24:.1f} days (times in {trace.unit}); {trace.overlapping:,} began while their node "
             f"was down already (down while any fault is open)"
             + (f"; {trace.skipped_ends:,} fault_end records with no open fault on their node, skipped"
                if trace.skipped_ends else "")]
    if lay.copies > 1:
        lines.append(f"  the job needs {lay.job_nodes:,} nodes: the trace is repeated over {lay.copies} disjoint copies "
                     f"of its nodes, copy k shifted by k/{lay.copies} of its duration (wrapped around)")
    lines.append(f"  job {p.gpus:,} GPUs = {lay.job_nodes:,} nodes; spare pool {lay.spare_nodes:,} nodes (the trace's "
                 f"other nodes, plus --spares extra ones that never fail); job faults {len(lay.failures):,}, "
                 f"waited for a repaired node {lay.waits:,}, faults of spares {lay.spare_faults:,}, "
                 f"not an interruption {lay.not_interruptions:,}")
    m = match_share(trace, classes)
    matched = n - m[""]
    lines.append(f"  class match: {matched:,} of {n:,} faults ({100 * matched / max(1, n):.1f} %) matched an entry: "
                 f"{m['description']:,} on the description, {m['class']:,} on the class, {m['fallback']:,} only a "
                 f"fallback entry (no cause given); with a cause: {100 * (m['description'] + m['class']) / max(1, n):.1f} %")
    unknown = sum(lay.unknown.values())
    lines.append(f"  unknown classes: {unknown:,}" + (" (replayed as sudden: " + ", ".join(
        f"{c!r} x{k}" for c, k in sorted(lay.unknown.items(), key=lambda kv: -kv[1])[:8]) + ")" if unknown else ""))
    return "\n".join(lines)


def table(results: dict[str, TraceSummary], p: Params) -> str:
    lines = [f"{'strategy':<44} {'interval':>12} {'ETTR':>7} {'p5 ETTR':>8} {'lost GPU-h':>11} {'hand-overs':>11} "
             f"{'double fail':>12} {'breaker ref':>12} {'P(wait spare)':>14}"]
    for s in results.values():
        lines.append(f"{LABELS[s.strategy]:<44} {s.interval:>12} {s.ettr_mean:>7.4f} {s.ettr_p5:>8.4f} "
                     f"{sum(s.lost_gpu_hours.values()):>11,.0f} {s.migrations:>11.1f} {s.double_failures:>12.2f} "
                     f"{s.breaker_refusals:>12.2f} {s.waited_for_spare:>14.3f}")
    lines.append("lost GPU-hours by cause:")
    for s in results.values():
        top = sorted(s.lost_gpu_hours.items(), key=lambda kv: -kv[1])
        lines.append(f"  {s.strategy:<22} " + ", ".join(f"{k} {v:,.0f}" for k, v in top if v >= 0.5))
    return "\n".join(lines)


def main(args, p: Params, search: bool) -> int:
    """`sentinel simulate goodput --trace FILE`: prints the class table, the layout, every strategy."""
    import sys

    try:
        classes = load_classes(args.trace_classes)
        trace = load_trace(args.trace, args.trace_format, args.trace_time_unit, args.trace_nodes)
    except TraceError as exc:
        print(f"sentinel simulate goodput: {exc}", file=sys.stderr)
        return 2
    q, lay, results = replay(trace, p, classes, runs=args.runs, seed=args.seed, strategies=tuple(args.strategies),
                             optimise=search, extra_spares=args.spares or 0)
    print(classes.text())
    print(header(trace, lay, q, classes))
    print(table(results, q))
    return 0


# -- synthetic traces (validation, benches) ---------------------------------------------------------------
def synthetic_events(p: Params, nodes: int, rng: random.Random) -> list[dict]:
    """A trace drawn from the Poisson model itself: each of ``nodes`` nodes fails at
    ``p.rate_per_node_day`` with ``p.classes``' mix, is repaired after ``p.repair_hours`` (a
    process-class fault ends at once: the node survives it), and cannot fail while down.
    Replaying it must give the Poisson path's ETTR (tests/test_goodput_trace.py)."""
    from sentinel_tools.sim.goodput import PROCESS_CLASSES

    horizon = p.days * 24.0
    rate = p.rate_per_node_day / 24.0
    names = [c[0] for c in p.classes]
    weights = [c[1] for c in p.classes]
    events: list[tuple[float, str, bool, dict]] = []  # (time, node, is the end, event)
    for n in range(nodes):
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= horizon:
                break
            cls = rng.choices(names, weights)[0]
            end = t if cls in PROCESS_CLASSES else min(horizon, t + p.repair_hours)
            node = f"n{n:05d}"
            events.append((t, node, False, {"node": node, "time": t, "event": "fault_start", "class": cls}))
            events.append((end, node, True, {"node": node, "time": end, "event": "fault_end", "class": cls}))
            t = end
    events.sort(key=lambda e: e[:3])  # a process-class fault ends at its own start: start first
    return [e[3] for e in events]


# The (Class, Desc) pairs of a published trace (stepfun-ai/InfiniteHBD-Trace, fault_statistics.json),
# by the Llama 3 class they stand for: synthetic events rewritten in the fault-records format.
PUBLISHED_PAIRS = {
    "faulty_gpu": ("GPU", "GPU xid Error"), "gpu_hbm3_memory": ("GPU", "GPU DBE(Double Bit ECC) > Threshold"),
    "software_bug": ("Software Failure", "Software bug"), "network_switch_cable": ("Parameter Plane Cable", "Link Down"),
    "host_maintenance": ("Change", "Host maintenance"), "gpu_sram_memory": ("GPU", "GPU SRAM error"),
    "gpu_system_processor": ("GPU", "GSP timeout"), "nic": ("NIC", "NIC Lost"),
    "nccl_watchdog_timeout": ("Training Task Troubleshooting", "NCCL watchdog timeout"),
    "silent_data_corruption": ("GPU", "Silent Data Corruption"), "gpu_thermal": ("GPU", "GPU Temperature High"),
    "ssd": ("File System", "FS: Multiple Disk FS Error"), "power_supply": ("Power Supply", "Power Supply Failure detected"),
    "server_chassis": ("Motherboard", "Motherboard Failed"), "io_expansion_board": ("Riser Card", "RiserCard Fault"),
    "dependency": ("Software Tool", "Dependency unavailable"), "cpu": ("CPU", "Machine Check Exception ( Uncorrectable )"),
    "system_memory": ("Memory", "DIMM uncorrectable error"),
}


def as_fault_records(events: list[dict], unit: str = "days") -> list[dict]:
    """``synthetic_events``' events (times in hours) as published fault records: node_id,
    event_time in ``unit``, event_type, fault_type {Level, Class, Desc} (PUBLISHED_PAIRS)."""
    out = []
    for e in events:
        cls, desc = PUBLISHED_PAIRS.get(e["class"], ("Unknown Error", "Unknown Error"))
        out.append({"node_id": e["node"], "event_time": round(e["time"] / UNITS[unit], 9), "event_type": e["event"],
                    "fault_type": {"Level": "Hardware Failure", "Class": cls, "Desc": desc}})
    return out
