"""What a node fault trace and the fault class table say (read and checked; nothing replayed here).

Two trace formats (docs/goodput.md, "Replaying a fault trace"):

* ``events``, Sentinel's own, as JSON or CSV:

  - JSON: ``{"time_unit": "days", "duration": 365, "nodes": 400, "events": [{...}, ...]}``
    (``duration`` optional, in the same unit, default: the last event; ``nodes`` optional, the
    cluster's node count or its list of ids, default: the nodes the events name — a node that
    never failed appears in no event), or a bare list of events whose time key names its unit
    (``time_seconds`` / ``time_hours`` / ``time_days``).
  - CSV: a header ``node,time_days,event,class,description`` (or ``time`` plus a comment line
    ``# time_unit: days`` before it; ``# duration: 365`` and ``# nodes: 400`` likewise);
    ``description`` is optional.
  - each event: ``node`` (any string id), the time, ``event`` = ``fault_start`` | ``fault_end``,
    ``class`` (free text) and an optional ``description``.

* ``fault-records``, as public traces are published (e.g. stepfun-ai/InfiniteHBD-Trace, SIGCOMM
  2025): a JSON list of ``{"node_id", "event_time", "event_type", "fault_type": {"Level",
  "Class", "Desc"}}``, ``event_time`` in days by default (that trace's unit; ``time_unit``
  overrides). ``Class`` is the class, ``Desc`` the description, ``Level`` is checked and kept.

In both, events are in time order. A node may have several faults open at once (a real trace
does): it is down while any of them is open. A ``fault_end`` closes the node's open fault of the
same class and description, else its oldest open one; a fault still open at the end lasts to the
end. An end with no open fault on its node is an error in the ``events`` format (ours: fix the
file) and is counted and skipped in ``fault-records`` (the trace as it comes).
"""

from __future__ import annotations

import csv
import fnmatch
import io
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

KINDS = ("predicted", "sudden", "process", "none")
UNITS = {"seconds": 1 / 3600, "hours": 1.0, "days": 24.0}  # to hours
EVENTS = ("fault_start", "fault_end")
FORMATS = ("auto", "events", "fault-records")
RECORDS_UNIT = "days"  # the unit of event_time in the published fault-record traces
MAX_BYTES = 64 << 20
MAX_NODES = 1_000_000  # a declared node count (each quiet node is a row of the layout)
_NORM = re.compile(r"[^a-z0-9]+")
_NATURAL = re.compile(r"(\d+)")


class TraceError(ValueError):
    """A trace or class table the simulator cannot use; the message names the file and line."""


def normalise(cls: str) -> str:
    return _NORM.sub("_", cls.lower()).strip("_") or "unknown"


def natural_key(node: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in _NATURAL.split(node))


# -- the class table --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassRule:
    name: str
    kind: str
    predictable: float
    match: tuple[str, ...]
    origin: str  # "shipped" or the override file
    fallback: bool = False  # tried only when no other entry names or matches the description or class


@dataclass(frozen=True)
class Match:
    rule: ClassRule | None
    on: str  # "description", "class", "fallback" or "" (nothing matched)


@dataclass
class ClassTable:
    rules: list[ClassRule]
    _seen: dict[tuple[str, str], Match] = field(default_factory=dict, repr=False)

    def match(self, cls: str, description: str = "") -> Match:
        """The entry for a fault: its description first (when it has one), then its class; on each,
        an entry's exact name, then the entries' globs in order. Fallback entries come last."""
        key = (cls, description)
        if key not in self._seen:
            self._seen[key] = self._match(cls, description)
        return self._seen[key]

    def lookup(self, cls: str, description: str = "") -> ClassRule | None:
        return self.match(cls, description).rule

    def _match(self, cls: str, description: str) -> Match:
        names = [("description", normalise(description))] if description.strip() else []
        names.append(("class", normalise(cls)))
        for fallback in (False, True):
            rules = [r for r in self.rules if r.fallback == fallback]
            for on, name in names:
                hit = next((r for r in rules if r.name == name), None) or next(
                    (r for r in rules if any(fnmatch.fnmatchcase(name, g) for g in r.match)), None)
                if hit:
                    return Match(hit, "fallback" if fallback else on)
        return Match(None, "")

    def text(self) -> str:
        lines = ["class table (kind, share predicted; on the description, then the class: first an exact name, "
                 "then globs in this order; fallback entries last):"]
        for r in self.rules:
            share = f"{r.predictable:.2f}" if r.kind == "predicted" else "-"
            lines.append(f"  {r.name:<26} {r.kind:<9} {share:>5}  {', '.join(r.match) or '-'}"
                         + (" (fallback)" if r.fallback else "") + ("" if r.origin == "shipped" else f"  <- {r.origin}"))
        return "\n".join(lines)


def _rules_from(data: dict, origin: str) -> list[ClassRule]:
    classes = data.get("classes")
    if not isinstance(classes, dict) or set(data) - {"classes"}:
        raise TraceError(f"{origin}: a class table has one table [classes.<name>], got keys {sorted(data)}")
    out = []
    for name, entry in classes.items():
        where = f"{origin}: [classes.{name}]"
        if not isinstance(entry, dict) or set(entry) - {"kind", "predictable", "match", "fallback"}:
            raise TraceError(f"{where}: keys are kind, predictable, match, fallback")
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
        fallback = entry.get("fallback", False)
        if not isinstance(fallback, bool):
            raise TraceError(f"{where}: fallback must be true or false, not {fallback!r}")
        out.append(ClassRule(normalise(name), kind, float(share), tuple(match), origin, fallback))
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


# -- the trace ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    node: str
    time: float  # hours from the trace's start
    event: str
    cls: str
    description: str
    line: int


@dataclass(frozen=True)
class Fault:
    """One fault of one node, from its start to its end (hours); the node is down in between."""

    node: str
    time: float
    end: float
    cls: str
    description: str
    line: int

    @property
    def label(self) -> str:
        return f"{self.cls} / {self.description}" if self.description else self.cls


@dataclass
class Trace:
    path: str
    events: list[Event]
    duration: float  # hours
    unit: str
    declared: list[str] = field(default_factory=list)  # nodes the trace lists, faulty or not
    faults: list[Fault] = field(default_factory=list)  # in start order
    overlapping: int = 0  # faults that started while their node was down already
    skipped_ends: int = 0  # fault-records: ends with no open fault on their node (counted, skipped)
    format: str = "events"

    @property
    def nodes(self) -> list[str]:
        """Every node of the traced cluster, in natural order of the ids."""
        return sorted(set(self.declared) | {e.node for e in self.events}, key=natural_key)


def load_trace(path: str, fmt: str = "auto", time_unit: str | None = None, nodes: int | None = None) -> Trace:
    """Read and check a trace; every fault is a TraceError naming the file and line (and record).
    ``time_unit`` and ``nodes`` stand in for what a fault-records trace cannot say."""
    if fmt not in FORMATS:
        raise TraceError(f"{path}: unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # never more: a FIFO or /dev/zero is refused, not read for ever
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise TraceError(f"{path}: more than the {MAX_BYTES:,} bytes a trace may have")
    text = raw.decode("utf-8", errors="replace")
    if fmt == "auto":
        fmt = "fault-records" if _looks_like_records(text) else "events"
    if fmt == "fault-records":
        rows = _record_rows(path, text)
        unit, duration, declared = time_unit or RECORDS_UNIT, None, nodes
    elif text.lstrip().startswith(("[", "{")):
        rows, unit, duration, declared = _json_rows(path, text)
    else:
        rows, unit, duration, declared = _csv_rows(path, text)
    if fmt == "events" and nodes is not None:
        declared = nodes if declared is None else declared
    trace = check(path, rows, unit, duration, lenient=fmt == "fault-records")
    trace.format = fmt
    trace.declared = _declared_nodes(path, declared, trace)
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
    named = {e.node for e in trace.events}
    if nodes < len(named):
        raise TraceError(f"{path}: nodes = {nodes}, but the events name {len(named)} nodes")
    # the nodes that never failed have no id in the trace: name them so they sort after the others
    return [f"~quiet-{i:06d}" for i in range(nodes - len(named))]


def _looks_like_records(text: str) -> bool:
    head = text.lstrip()
    if not head.startswith("["):
        return False
    try:
        first, _ = json.JSONDecoder().raw_decode(head[1:].lstrip())
    except (json.JSONDecodeError, RecursionError):
        return False
    return isinstance(first, dict) and "node_id" in first and "event_type" in first


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


def _elements(path: str, text: str):
    """(line, value) of each element of the JSON list ``text``, the line its value starts on."""
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    pos = ws.match(text).end()
    if text[pos:pos + 1] != "[":
        raise TraceError(f"{path}: a fault-records trace is a JSON list of records")
    pos, line, counted = pos + 1, 1, 0
    while True:
        pos = ws.match(text, pos).end()
        if text[pos:pos + 1] == "]":
            if text[pos + 1:].strip():
                raise TraceError(f"{path}: text after the list of records")
            return
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, pos = dec.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise TraceError(f"{path}:{line}: not JSON: {exc}") from None
        yield line, value


def _record_rows(path: str, text: str) -> list[tuple[int, dict]]:
    """The published records as events: node_id, event_time, event_type, fault_type.Class/.Desc."""
    rows = []
    for i, (line, rec) in enumerate(_elements(path, text)):
        where = f"{path}:{line}: record {i + 1}"
        if not isinstance(rec, dict):
            raise TraceError(f"{where}: not an object")
        for key in ("node_id", "event_time", "event_type", "fault_type"):
            if key not in rec:
                raise TraceError(f"{where}: no {key!r} (a record is {{node_id, event_time, event_type, fault_type: "
                                 f"{{Level, Class, Desc}}}})")
        ft = rec["fault_type"]
        if not isinstance(ft, dict):
            raise TraceError(f"{where}: fault_type must be an object {{Level, Class, Desc}}, not {ft!r}")
        for key in ("Level", "Class", "Desc"):
            if key in ft and not isinstance(ft[key], str):
                raise TraceError(f"{where}: fault_type.{key} must be text, not {ft[key]!r}")
        if rec["event_type"] == "fault_start" and not ft.get("Class", "").strip():
            raise TraceError(f"{where}: a fault_start needs fault_type.Class")
        rows.append((line, {"node": rec["node_id"], "time": rec["event_time"], "event": rec["event_type"],
                            "class": ft.get("Class", ""), "description": ft.get("Desc", ""),
                            "_where": f"record {i + 1}"}))
    return rows


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


def _time(where: str, ev: dict, unit: str | None) -> tuple[float, str]:
    """The event's time in hours, and the unit it was given in."""
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
    value = ev[tkey]
    try:
        t = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise TraceError(f"{where}: time must be a number, not {value!r}") from None
    if not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: time must be finite and >= 0, not {value!r}")
    return t * UNITS[u], u


def _event(where: str, ev: dict, t: float, line: int) -> Event:
    node, kind, cls = ev.get("node"), ev.get("event"), ev.get("class")
    if not isinstance(node, (str, int)) or isinstance(node, bool) or str(node) == "":
        raise TraceError(f"{where}: node must be a non-empty id, not {node!r}")
    if kind not in EVENTS:
        raise TraceError(f"{where}: unknown event type {kind!r} (fault_start or fault_end)")
    if not isinstance(cls, str) or not cls.strip():
        if kind == "fault_start":
            raise TraceError(f"{where}: a fault_start needs a class (free text)")
        cls = ""
    desc = ev.get("description", "")
    return Event(str(node), t, kind, cls.strip(), (desc if isinstance(desc, str) else str(desc)).strip(), line)


def check(path: str, rows: list[tuple[int, dict]], unit: str | None, duration: float | None,
          lenient: bool = False) -> Trace:
    """The trace of these rows ((line, event) in file order), its faults paired start to end."""
    events: list[Event] = []
    faults: list[Fault | None] = []
    opened: dict[str, list[tuple[int, Event]]] = {}  # node -> its open faults (index into faults, start)
    last, overlapping, skipped = -math.inf, 0, 0
    for line, ev in rows:
        where = f"{path}:{line}" + (f": {ev['_where']}" if "_where" in ev else "")
        t, u = _time(where, ev, unit)
        unit = unit or u
        if t < last:
            raise TraceError(f"{where}: time goes backwards ({t / UNITS[u]:g} {u} after {last / UNITS[u]:g}): "
                             f"events must be in time order")
        last = t
        e = _event(where, ev, t, line)
        mine = opened.setdefault(e.node, [])
        if e.event == "fault_start":
            overlapping += bool(mine)
            mine.append((len(faults), e))
            faults.append(None)
        elif not mine:
            if not lenient:
                raise TraceError(f"{where}: fault_end for node {e.node} without a fault_start")
            skipped += 1
            continue
        else:
            same = [k for k, (_, s) in enumerate(mine) if (s.cls, s.description) == (e.cls or s.cls, e.description
                                                                                       or s.description)]
            i, began = mine.pop(same[0] if same else 0)
            faults[i] = Fault(e.node, began.time, t, began.cls, began.description, began.line)
            e = Event(e.node, t, e.event, e.cls or began.cls, e.description or began.description, line)
        events.append(e)
    if not events:
        raise TraceError(f"{path}: no events")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float))
                                 or not math.isfinite(duration)):
        raise TraceError(f"{path}: duration must be a finite number, not {duration!r}")
    span = last if duration is None else float(duration) * UNITS[unit or "hours"]
    if span < last or span <= 0:
        raise TraceError(f"{path}: duration {duration!r} ends before the last event")
    for mine in opened.values():  # still open at the end: down to the end
        for i, began in mine:
            faults[i] = Fault(began.node, began.time, span, began.cls, began.description, began.line)
    return Trace(path, events, span, unit or "hours", faults=[f for f in faults if f is not None],
                 overlapping=overlapping, skipped_ends=skipped)
