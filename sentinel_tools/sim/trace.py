"""Replaying a node fault trace through every strategy (``sentinel simulate goodput --trace FILE``).

The Poisson path (``goodput.draw_failures``) draws independent failures with a fixed class mix.
Real clusters fail in bursts (a switch, a power feed, a bad roll-out) with long and short repairs
and many faults of no hardware class; this module replays such a history instead.

The format (docs/goodput.md, "Replaying a fault trace"), as JSON or CSV:

* JSON: ``{"time_unit": "days", "duration": 365, "nodes": 400, "events": [{...}, ...]}``
  (``duration`` optional, in the same unit, default: the last event; ``nodes`` optional, the
  cluster's node count or its list of ids, default: the nodes the events name — a node that never
  failed appears in no event), or a bare list of events whose time key names its unit
  (``time_seconds`` / ``time_hours`` / ``time_days``).
* CSV: a header ``node,time_days,event,class,description`` (or ``time`` plus a comment line
  ``# time_unit: days`` before it; ``# duration: 365`` and ``# nodes: 400`` likewise);
  ``description`` is optional.
* each event: ``node`` (any string id), the time, ``event`` = ``fault_start`` | ``fault_end``,
  ``class`` (free text) and an optional ``description``. Events are in time order; a node's
  ``fault_start`` is followed by its ``fault_end`` (a fault still open at the end lasts to the end).

Classes map to what Sentinel would see and do (``trace_classes.toml``, overridable): predicted
with a lead time, a sudden node loss, a process crash the node survives, or no interruption.

Trace -> job: the job's nodes are the first ``G / gpus_per_node`` trace nodes in natural order of
their ids (racks usually number consecutively, so ``adjacent`` replica placement is what it says);
the other nodes are the spare pool. A node is unavailable from ``fault_start`` to ``fault_end``.
A job node's fault (other than ``process`` / ``none``) takes the spare free longest; the failed
node joins the pool once repaired. When the job needs more nodes than the trace has, the trace is
repeated over disjoint copies of its nodes, copy k shifted by k/copies of its duration (wrapping
around), and the output says so. Two replica partners down at once is then simply what happens
when the trace has them fail together.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import random
import re
import statistics
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from sentinel_tools.sim.goodput import (LABELS, STRATEGIES, Failure, Outcome, Params, interval_text, optimise_interval,
                                        simulate)

KINDS = ("predicted", "sudden", "process", "none")
UNITS = {"seconds": 1 / 3600, "hours": 1.0, "days": 24.0}  # to hours
EVENTS = ("fault_start", "fault_end")
MAX_BYTES = 64 << 20
MAX_NODES = 1_000_000  # a declared node count (each quiet node is a row of the layout)
_NORM = re.compile(r"[^a-z0-9]+")
_NATURAL = re.compile(r"(\d+)")


class TraceError(ValueError):
    """A trace or class table the simulator cannot use; the message names the file and line."""


def normalise(cls: str) -> str:
    return _NORM.sub("_", cls.lower()).strip("_") or "unknown"


# -- the class table --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassRule:
    name: str
    kind: str
    predictable: float
    match: tuple[str, ...]
    origin: str  # "shipped" or the override file


@dataclass
class ClassTable:
    rules: list[ClassRule]

    def lookup(self, cls: str) -> ClassRule | None:
        name = normalise(cls)
        for r in self.rules:
            if r.name == name:
                return r
        for r in self.rules:
            if any(fnmatch.fnmatchcase(name, g) for g in r.match):
                return r
        return None

    def text(self) -> str:
        lines = ["class table (kind, share predicted; first exact name, then globs in this order):"]
        for r in self.rules:
            share = f"{r.predictable:.2f}" if r.kind == "predicted" else "-"
            lines.append(f"  {r.name:<26} {r.kind:<9} {share:>5}  {', '.join(r.match) or '-'}"
                         + ("" if r.origin == "shipped" else f"  <- {r.origin}"))
        return "\n".join(lines)


def _rules_from(data: dict, origin: str) -> list[ClassRule]:
    classes = data.get("classes")
    if not isinstance(classes, dict) or set(data) - {"classes"}:
        raise TraceError(f"{origin}: a class table has one table [classes.<name>], got keys {sorted(data)}")
    out = []
    for name, entry in classes.items():
        where = f"{origin}: [classes.{name}]"
        if not isinstance(entry, dict) or set(entry) - {"kind", "predictable", "match"}:
            raise TraceError(f"{where}: keys are kind, predictable, match")
        kind = entry.get("kind")
        if kind not in KINDS:
            raise TraceError(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
        share = entry.get("predictable", 1.0 if kind == "predicted" else 0.0)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise TraceError(f"{where}: predictable must be a number in [0, 1], not {share!r}")
        if kind != "predicted" and share:
            raise TraceError(f"{where}: only kind = \"predicted\" takes a predictable share")
        match = entry.get("match", [])
        if not isinstance(match, list) or not all(isinstance(g, str) and g for g in match):
            raise TraceError(f"{where}: match must be a list of glob strings")
        out.append(ClassRule(normalise(name), kind, float(share), tuple(match), origin))
    return out


def load_classes(override: str | None = None) -> ClassTable:
    """The shipped table, with ``override``'s entries first (replacing shipped ones by name)."""
    shipped = tomllib.loads((resources.files("sentinel_tools.sim") / "trace_classes.toml").read_text())
    rules = _rules_from(shipped, "shipped")
    if override:
        try:
            data = tomllib.loads(Path(override).read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(f"{override}: cannot read the class table: {exc}") from None
        mine = _rules_from(data, override)
        names = {r.name for r in mine}
        rules = mine + [r for r in rules if r.name not in names]
    return ClassTable(rules)


# -- the trace file --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    node: str
    time: float  # hours from the trace's start
    event: str
    cls: str
    description: str
    line: int


@dataclass
class Trace:
    path: str
    events: list[Event]
    duration: float  # hours
    unit: str
    declared: list[str] = field(default_factory=list)  # nodes the trace lists, faulty or not

    @property
    def nodes(self) -> list[str]:
        """Every node of the traced cluster, in natural order of the ids."""
        return sorted(set(self.declared) | {e.node for e in self.events}, key=natural_key)


def natural_key(node: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in _NATURAL.split(node))


def load_trace(path: str) -> Trace:
    """Read and check a trace; every fault is a TraceError naming the file and line."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # never more: a FIFO or /dev/zero is refused, not read for ever
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise TraceError(f"{path}: more than the {MAX_BYTES:,} bytes a trace may have")
    text = raw.decode("utf-8", errors="replace")
    if text.lstrip().startswith(("[", "{")):
        rows, unit, duration, nodes = _json_rows(path, text)
    else:
        rows, unit, duration, nodes = _csv_rows(path, text)
    trace = _check(path, rows, unit, duration)
    trace.declared = _declared_nodes(path, nodes, trace)
    return trace


def _declared_nodes(path: str, nodes, trace: Trace) -> list[str]:
    if nodes is None:
        return []
    if isinstance(nodes, list):
        if not all(isinstance(n, (str, int)) and not isinstance(n, bool) and str(n) for n in nodes):
            raise TraceError(f"{path}: nodes must be a count or a list of node ids")
        return [str(n) for n in nodes]
    if isinstance(nodes, str) and nodes.strip().isdigit() and len(nodes.strip()) <= 9:  # a CSV '# nodes: 512'
        nodes = int(nodes)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 0 <= nodes <= MAX_NODES:
        raise TraceError(f"{path}: nodes must be a count (a whole number up to {MAX_NODES:,}) or a list of node ids, "
                         f"not {nodes!r}")
    count = nodes
    named = {e.node for e in trace.events}
    if count < len(named):
        raise TraceError(f"{path}: nodes = {count}, but the events name {len(named)} nodes")
    # the nodes that never failed have no id in the trace: name them so they sort after the others
    return [f"~quiet-{i:06d}" for i in range(count - len(named))]


def _json_rows(path: str, text: str):
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise TraceError(f"{path}: not JSON: {exc}") from None
    unit, duration, nodes = None, None, None
    if isinstance(data, dict):
        if set(data) - {"time_unit", "duration", "nodes", "events"} or "events" not in data:
            raise TraceError(f"{path}: a JSON trace is {{\"time_unit\", \"duration\" and \"nodes\" (optional), "
                             f"\"events\"}} or a list of events, got keys {sorted(data)}")
        unit, duration, nodes, data = data.get("time_unit"), data.get("duration"), data.get("nodes"), data["events"]
        if unit is None:
            raise TraceError(f"{path}: time_unit missing (one of {', '.join(UNITS)})")
    if not isinstance(data, list):
        raise TraceError(f"{path}: the events must be a JSON list")
    # a line number for each event: the line its object starts on
    starts = [m.start() for m in re.finditer(r"\{", text)]
    first = 1 if isinstance(json.loads(text), list) else 2
    lines = [text.count("\n", 0, s) + 1 for s in starts[first - 1:]] if starts else []
    rows = []
    for i, ev in enumerate(data):
        line = lines[i] if i < len(lines) else i + 1
        if not isinstance(ev, dict):
            raise TraceError(f"{path}:{line}: event {i + 1} is not an object")
        rows.append((line, ev))
    return rows, unit, duration, nodes


def _csv_rows(path: str, text: str):
    lines = text.splitlines()
    unit, duration, nodes, skip = None, None, None, 0
    for ln in lines:
        s = ln.strip()
        if not s.startswith("#"):
            break
        skip += 1
        m = re.match(r"#\s*(time_unit|duration|nodes)\s*[:=]\s*(\S+)", s)
        if m and m.group(1) == "time_unit":
            unit = m.group(2)
        elif m and m.group(1) == "nodes":
            nodes = m.group(2)
        elif m:
            try:
                duration = float(m.group(2))
            except ValueError:
                raise TraceError(f"{path}:{skip}: duration must be a number, not {m.group(2)!r}") from None
    reader = csv.DictReader(io.StringIO("\n".join(lines[skip:])))
    if not reader.fieldnames:
        raise TraceError(f"{path}: no CSV header (node,time_days,event,class[,description])")
    rows = []
    for i, row in enumerate(reader):
        if None in row:
            raise TraceError(f"{path}:{skip + i + 2}: more fields than the header names")
        rows.append((skip + reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items()}))
    return rows, unit, duration, nodes


def _check(path: str, rows: list[tuple[int, dict]], unit: str | None, duration: float | None) -> Trace:
    events: list[Event] = []
    open_since: dict[str, Event] = {}
    last = -math.inf
    for line, ev in rows:
        where = f"{path}:{line}"
        tkeys = [k for k in ev if k == "time" or k.startswith("time_")]
        if len(tkeys) != 1:
            raise TraceError(f"{where}: one time per event: time (with a declared time_unit) or "
                             f"time_seconds / time_hours / time_days")
        tkey = tkeys[0]
        u = unit if tkey == "time" else tkey[len("time_"):]
        if u is None:
            raise TraceError(f"{where}: the time unit is missing: declare time_unit (JSON key, or a CSV first "
                             f"line '# time_unit: days') or name the column time_seconds / time_hours / time_days")
        if u not in UNITS:
            raise TraceError(f"{where}: unknown time unit {u!r} (one of {', '.join(UNITS)})")
        unit = unit or u
        try:
            t = float(ev[tkey])
        except (TypeError, ValueError):
            raise TraceError(f"{where}: time must be a number, not {ev[tkey]!r}") from None
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{where}: time must be finite and >= 0, not {ev[tkey]!r}")
        t *= UNITS[u]
        if t < last:
            raise TraceError(f"{where}: time goes backwards ({t / UNITS[u]:g} {u} after {last / UNITS[u]:g}): "
                             f"events must be in time order")
        last = t
        node, kind, cls = ev.get("node"), ev.get("event"), ev.get("class")
        if not isinstance(node, (str, int)) or isinstance(node, bool) or str(node) == "":
            raise TraceError(f"{where}: node must be a non-empty id, not {node!r}")
        node = str(node)
        if kind not in EVENTS:
            raise TraceError(f"{where}: unknown event type {kind!r} (fault_start or fault_end)")
        if not isinstance(cls, str) or not cls.strip():
            if kind == "fault_start":
                raise TraceError(f"{where}: a fault_start needs a class (free text)")
            cls = ""
        desc = ev.get("description", "")
        e = Event(node, t, kind, cls, desc if isinstance(desc, str) else str(desc), line)
        if kind == "fault_start":
            if node in open_since:
                raise TraceError(f"{where}: node {node} starts a fault while its fault of line "
                                 f"{open_since[node].line} has not ended")
            open_since[node] = e
        else:
            if node not in open_since:
                raise TraceError(f"{where}: fault_end for node {node} without a fault_start")
            began = open_since.pop(node)
            e = replace(e, cls=e.cls or began.cls)
        events.append(e)
    if not events:
        raise TraceError(f"{path}: no events")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                 or not math.isfinite(duration)):
        raise TraceError(f"{path}: duration must be a finite number, not {duration!r}")
    span = last if duration is None else float(duration) * UNITS[unit or "hours"]
    if span < last or span <= 0:
        raise TraceError(f"{path}: duration {duration!r} ends before the last event")
    return Trace(path, events, span, unit or "hours")


# -- trace -> the job's failures ---------------------------------------------------------------------
@dataclass
class Layout:
    """How the job sits on the trace: its nodes, the spare pool, the copies."""

    copies: int
    job_nodes: int
    spare_nodes: int
    trace_nodes: int
    duration: float
    failures: list[tuple[Event, int, str, float]] = field(default_factory=list)  # (event, slot, kind, spare ready)
    unknown: dict[str, int] = field(default_factory=dict)
    not_interruptions: int = 0
    spare_faults: int = 0  # faults of nodes that were spares at the time
    waits: int = 0  # job faults that waited for a repaired node


def _copies(trace: Trace, copies: int) -> list[Event]:
    """The events of ``copies`` disjoint copies of the trace's nodes (``<node>#<k>``), copy k
    shifted by k/copies of the trace's duration and wrapped around; a fault cut by the wrap ends at
    the end of the trace and starts again at 0. Sorted by time, ends before starts."""
    if copies == 1:
        return list(trace.events)
    d = trace.duration
    out: list[Event] = []
    for k in range(copies):
        shift = d * k / copies
        started: dict[str, Event] = {}
        for e in trace.events:
            node = f"{e.node}#{k}"
            t = e.time + shift
            if e.event == "fault_start":
                started[node] = e
            elif e.time + shift >= d > started.pop(node).time + shift:  # the fault crosses the wrap
                out.append(replace(e, node=node, time=d))
                out.append(replace(e, node=node, time=0.0, event="fault_start"))
            out.append(replace(e, node=node, time=t - d if t >= d else t))
    out.sort(key=lambda e: (e.time, e.event == "fault_start"))
    return out


def layout(trace: Trace, p: Params, classes: ClassTable, extra_spares: int = 0) -> Layout:
    """The job's failures on the trace's nodes (strategy-independent): which slot each job fault
    hits, its kind, and when its replacement is free."""
    n_trace = len(trace.nodes)
    copies = max(1, math.ceil(p.nodes / n_trace))
    timed = _copies(trace, copies)
    # copy by copy, so copy 0 fills the first slots
    names = trace.nodes if copies == 1 else [f"{n}#{k}" for k in range(copies) for n in trace.nodes]
    names += [f"spare-{i}" for i in range(extra_spares)]
    job = {n: i for i, n in enumerate(names[:p.nodes])}
    pool: dict[str, float] = {n: 0.0 for n in names[p.nodes:]}  # spare -> free since
    ends: dict[str, list[float]] = {}  # node -> its faults' end times, in order
    for e in timed:
        if e.event == "fault_end":
            ends.setdefault(e.node, []).append(e.time)
    down_until: dict[str, float] = {}
    lay = Layout(copies, p.nodes, len(pool), n_trace, trace.duration)
    for e in timed:
        if e.event == "fault_end":
            continue
        t = e.time
        end = ends.get(e.node, [])
        until = end.pop(0) if end else math.inf
        down_until[e.node] = until
        rule = classes.lookup(e.cls)
        kind = rule.kind if rule else "sudden"
        if rule is None:
            lay.unknown[e.cls] = lay.unknown.get(e.cls, 0) + 1
        if e.node not in job:
            lay.spare_faults += e.node in pool
            continue
        if kind == "none":
            lay.not_interruptions += 1
            continue
        slot = job[e.node]
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
            del job[e.node]
            pool[e.node] = until  # back in the pool once repaired
        lay.failures.append((e, slot, kind, ready))
    return lay


def failures_for(lay: Layout, classes: ClassTable, p: Params, rng: random.Random) -> list[Failure]:
    """One replay's failures: the predicted share and lead times drawn (per replay) with ``rng``."""
    out = []
    horizon = lay.duration
    for e, slot, kind, ready in lay.failures:
        rule = classes.lookup(e.cls)
        share = rule.predictable if rule and kind == "predicted" else 0.0
        pred = rng.random() < share
        lead = rng.expovariate(1.0 / p.lead_mean_hours) if p.lead_mean_hours > 0 else 0.0
        spare = min(ready, horizon)
        out.append(Failure(e.time, e.cls, pred, lead, slot, kind="process" if kind == "process" else "sudden",
                           spare_ready=spare))
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
    draws = [failures_for(lay, classes, q, rng) for _ in range(runs)]
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


def header(trace: Trace, lay: Layout, p: Params) -> str:
    starts = sum(e.event == "fault_start" for e in trace.events)
    lines = [f"trace {trace.path}: {lay.trace_nodes:,} nodes, {starts:,} faults over {trace.duration / 24:.1f} days "
             f"(times in {trace.unit})"]
    if lay.copies > 1:
        lines.append(f"  the job needs {lay.job_nodes:,} nodes: the trace is repeated over {lay.copies} disjoint copies "
                     f"of its nodes, copy k shifted by k/{lay.copies} of its duration (wrapped around)")
    lines.append(f"  job {p.gpus:,} GPUs = {lay.job_nodes:,} nodes; spare pool {lay.spare_nodes:,} nodes (the trace's "
                 f"other nodes, plus --spares extra ones that never fail); job faults {len(lay.failures):,}, "
                 f"waited for a repaired node {lay.waits:,}, faults of spares {lay.spare_faults:,}, "
                 f"not an interruption {lay.not_interruptions:,}")
    unknown = sum(lay.unknown.values())
    lines.append(f"  unknown classes: {unknown:,}" + (" (replayed as sudden: " + ", ".join(
        f"{c!r} x{n}" for c, n in sorted(lay.unknown.items(), key=lambda kv: -kv[1])[:8]) + ")" if unknown else ""))
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
        trace = load_trace(args.trace)
    except TraceError as exc:
        print(f"sentinel simulate goodput: {exc}", file=sys.stderr)
        return 2
    q, lay, results = replay(trace, p, classes, runs=args.runs, seed=args.seed, strategies=tuple(args.strategies),
                             optimise=search, extra_spares=args.spares or 0)
    print(classes.text())
    print(header(trace, lay, q))
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
