"""Measured inputs for the goodput simulator: the ``--json`` reports of ``bench/`` (one shape,
``bench/_report.py``), or a bundle of them (``docs/measured.json``, ``bench/measure_all.py``),
turned into ``Params`` values, each with where it came from.

Precedence per input: a typed flag, else the last file given that measures it, else the default
(an assumption, said so). A file that is not a report, or that measures none of the inputs, is
refused with an error naming the file and what is wrong; nothing is half-read.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

VERSION = 1
BUNDLE_KIND = "sentinel-measured"
MAX_BYTES = 8 << 20
NAME = re.compile(r"^[a-z][a-z0-9_]*$")
REPORT_KEYS = {"bench", "version", "created", "host", "figures"}
OPTIONAL_REPORT_KEYS = {"runs"}  # bench/_report.py: each finished run, as it came
BUNDLE_KEYS = {"kind", "version", "created", "host", "reports", "inputs", "notes"}
# the rendezvous protocol of a one-node replacement over N (bench/replacement_scale.py, Sentinel's handler)
PROTOCOL_FIGURE = re.compile(r"^replacement_protocol_n(\d+)_seconds$")


class MeasuredError(ValueError):
    """A measured-figures file the simulator cannot use; the message names the file and the fault."""


@dataclass(frozen=True)
class Report:
    path: str
    bench: str
    created: str
    cpus: int | None
    figures: dict[str, float]


@dataclass(frozen=True)
class Input:
    """One simulator input a benchmark measures: ``field`` of Params, from the first of
    ``figures`` present (each with the factor to Params' unit), checked against ``valid``."""

    field: str
    figures: tuple[tuple[str, float], ...]
    unit: str
    default_note: str
    valid: tuple[float, float] = (0.0, math.inf)
    noise: float = 0.0  # a measured value down to -noise is read as 0 (an overhead lost in run-to-run noise)
    # (figure, marker): a report holding ``marker`` uses ``figure`` for something else (renamed since)
    unless: tuple[tuple[str, str], ...] = ()
    first: bool = False  # the first of ``figures`` any report holds wins (else: the last report holding any)


INPUTS: tuple[Input, ...] = (
    # like for like (issue 45): bench/memory_tier.py's async stall, measured in the run that measures the
    # memory tier's, wins over bench/snapshot_stall.py's wherever a report has it (``first``)
    Input("stall_seconds_per_gb", (("big_async_stall_seconds_per_gb", 1.0), ("async_stall_seconds_per_gb", 1.0)),
          "s/GB", "assumed 0.25 s per GB staged (about 4 GB/s to host memory)", first=True),
    Input("async_cpu_seconds_per_gb", (("big_async_background_cpu_seconds_per_gb", 1.0),), "CPU-s/GB",
          "assumed 0: not measured", noise=1.0),
    Input("memory_stall_seconds_per_gb", (("big_memory_stall_seconds_per_gb", 1.0),), "s/GB",
          "assumed 0.25 s per GB, as the async stall's default"),
    Input("memory_cpu_seconds_per_gb", (("big_memory_background_cpu_seconds_per_gb", 1.0),), "CPU-s/GB",
          "assumed 0: not measured", noise=1.0),
    Input("node_write_gbps", (("dcp_save_bytes_per_second", 1e-9),), "GB/s",
          "assumed 5 GB/s per node to the shared filesystem", (1e-6, math.inf)),
    # typed only: this machine's K = 1 wall-clock fraction (memory_snapshot_overhead_fraction) holds its
    # 2 cores' contention and its 0.4 MiB state; the simulator builds the cost per GB instead
    Input("memory_overhead_fraction", (), "of a step",
          "the per-GB terms (memory_stall/cpu_seconds_per_gb, background_contention)", (0.0, 10.0)),
    # bench/migration.py before issue 16 wrote the cold-spare torchrun path as migration_*; since,
    # migration_* is the warm spare (warm_spare_* says so) and the cold spare is cold_spare_torchrun_*
    Input("migrate_seconds", (("cold_spare_torchrun_trip_to_first_step_seconds", 1.0),
                              ("migration_trip_to_first_step_seconds", 1.0)), "s",
          "assumed 120 s (2 min)",
          unless=(("migration_trip_to_first_step_seconds", "warm_spare_trip_to_first_step_seconds"),)),
    Input("migrate_warm_seconds", (("warm_spare_trip_to_first_step_seconds", 1.0),), "s",
          "assumed 3 s: issue 16's target for a warm spare, not yet measured"),
    Input("restore_memory_seconds", (("restore_from_memory_seconds", 1.0),), "s",
          "assumed 2 s: issue 15's memory tier, not yet measured"),
    Input("restore_peer_seconds", (("restore_from_peer_seconds", 1.0),), "s",
          "assumed 5 s: issue 15's peer replica, not yet measured"),
    Input("restore_disk_seconds", (("restore_from_disk_seconds", 1.0),), "s",
          "only the bandwidth model (state per node / filesystem share per node)"),
    Input("detect_seconds", (("migration_stage_detected_seconds", 1.0), ("ebpf_to_trainer_p50_seconds", 1.0)), "s",
          "assumed 1 s"),
)
BY_FIELD = {i.field: i for i in INPUTS}
CURVE_NOTE = "assumed a flat 10 s (no growth): run bench/replacement_scale.py --json"


def _fail(path: str, what: str) -> MeasuredError:
    return MeasuredError(f"{path}: {what}")


def _report(path: str, doc: object, where: str = "") -> Report:
    at = f"{path}{where}"
    if not isinstance(doc, dict):
        raise _fail(at, f"a report is a JSON object, not {type(doc).__name__}")
    unknown = sorted(set(doc) - REPORT_KEYS - OPTIONAL_REPORT_KEYS)
    if unknown:
        raise _fail(at, f"unknown key {unknown[0]!r} (a report has exactly {sorted(REPORT_KEYS)})")
    missing = sorted(REPORT_KEYS - set(doc))
    if missing:
        raise _fail(at, f"missing key {missing[0]!r} (written by bench/_report.py?)")
    if doc["version"] != VERSION or isinstance(doc["version"], bool):
        raise _fail(at, f"version {doc['version']!r} is not {VERSION}: written by another Sentinel?")
    bench = doc["bench"]
    if not isinstance(bench, str) or not NAME.match(bench):
        raise _fail(at, f"bench must be a lower_case name, not {bench!r}")
    if not isinstance(doc["created"], str):
        raise _fail(at, "created must be an ISO 8601 string")
    host = doc["host"]
    if not isinstance(host, dict):
        raise _fail(at, "host must be an object")
    cpus = host.get("cpus")
    if cpus is not None and (not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1):
        raise _fail(at, f"host.cpus must be a positive integer, not {cpus!r}")
    figures = doc["figures"]
    if not isinstance(figures, dict) or not figures:
        raise _fail(at, "figures must be a non-empty object of name: number")
    for name, value in figures.items():
        if not NAME.match(name):
            raise _fail(at, f"figure name {name!r} is not lower_case_with_unit")
        if value is None:  # a bench that could not measure a figure may write null: read as not measured
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _fail(at, f"figure {name!r} is {value!r}, not a finite number")
    return Report(path, bench, doc["created"], cpus, {k: float(v) for k, v in figures.items() if v is not None})


def load(path: str | Path) -> list[Report]:
    """The reports in one file: a bench report, or a bundle of them. Raises MeasuredError."""
    path = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise _fail(path, f"larger than {MAX_BYTES >> 20} MB: not a benchmark report")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _fail(path, "not UTF-8 text: not a benchmark report") from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if isinstance(doc, dict) and doc.get("kind") == BUNDLE_KIND:
        unknown = sorted(set(doc) - BUNDLE_KEYS)
        if unknown:
            raise _fail(path, f"unknown key {unknown[0]!r} in a measured bundle")
        if doc.get("version") != VERSION:
            raise _fail(path, f"bundle version {doc.get('version')!r} is not {VERSION}")
        reports = doc.get("reports")
        if not isinstance(reports, list) or not reports:
            raise _fail(path, "a measured bundle needs a non-empty list of reports")
        return [_report(path, r, f" (report {i + 1})") for i, r in enumerate(reports)]
    return [_report(path, doc)]


def uses(report: Report) -> list[str]:
    """The simulator inputs this report measures."""
    got = [i.field for i in INPUTS if any(name in report.figures for name, _ in i.figures)]
    if sum(1 for name in report.figures if PROTOCOL_FIGURE.match(name)) >= 2:
        got.append("restart_curve")
    return got


def load_all(paths: list[str]) -> list[Report]:
    """Every file's reports, in order; a file none of whose reports gives an input is refused."""
    out: list[Report] = []
    for path in paths:
        reports = load(path)
        if not any(uses(r) for r in reports):
            benches = ", ".join(sorted({r.bench for r in reports}))
            raise _fail(path, f"{benches} measures none of the simulator's inputs; it takes "
                              f"{', '.join(sorted({n for i in INPUTS for n, _ in i.figures}))} and replacement_protocol_n<N>_seconds "
                              "for two or more N (bench/replacement_scale.py)")
        out.extend(reports)
    return out


def fit_power(points: dict[int, float]) -> tuple[float, float, float]:
    """Least squares of log y = log a + b log N through (nodes, seconds): the measured protocol
    curve as a * N^b. Returns (a, b, rms of the log residual). No choice of form: the exponent is
    what the measurement says (close to 0 for a protocol whose cost does not grow)."""
    pts = [(math.log(n), math.log(max(v, 1e-6))) for n, v in sorted(points.items())]
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    la = my - b * mx
    rms = math.sqrt(statistics.fmean((la + b * x - y) ** 2 for x, y in pts))
    return math.exp(la), b, rms


def _find(inp: Input, reports: list[Report]) -> tuple[Report, str, float] | None:
    """(report, figure, value in Params' unit) for ``inp``: the last report holding one of its
    figures (each report's first), or with ``inp.first`` the last report holding its first figure
    any report holds."""
    groups = [[nf] for nf in inp.figures] if inp.first else [list(inp.figures)]
    for names in groups:
        found = None
        for report in reports:  # later files override earlier ones
            for name, factor in names:
                if any(name == figure and marker in report.figures for figure, marker in inp.unless):
                    continue
                if name in report.figures:
                    found = (report, name, report.figures[name] * factor)
                    break
        if found is not None:
            return found
    return None


def resolve(reports: list[Report], typed: dict[str, object], defaults: dict[str, object],
            nodes: int) -> tuple[dict[str, object], dict[str, str]]:
    """Params values for every measurable input and a line per input saying where it came from."""
    values: dict[str, object] = {}
    where: dict[str, str] = {}
    for inp in INPUTS:
        if typed.get(inp.field) is not None:
            values[inp.field], where[inp.field] = typed[inp.field], "typed (command line)"
            continue
        found = _find(inp, reports)
        if found is None:
            values[inp.field], where[inp.field] = defaults[inp.field], f"default: {inp.default_note}"
            continue
        report, name, value = found
        lo, hi = inp.valid
        note = ""
        if lo - inp.noise <= value < lo:
            value, note = lo, f", measured {report.figures[name]:.4g}: within noise, taken as {lo:g}"
        if not lo <= value <= hi:
            raise _fail(report.path, f"figure {name!r} = {report.figures[name]!r} is outside what {inp.field} can be")
        values[inp.field] = value
        where[inp.field] = f"measured: {report.path} ({report.bench}: {name}{note})"
    if typed.get("restart_curve") is not None:
        values["restart_curve"], where["restart_curve"] = typed["restart_curve"], "typed (command line)"
        return values, where
    points: dict[int, float] = {}
    source = None
    for report in reports:
        pts = {int(m.group(1)): v for name, v in report.figures.items() if (m := PROTOCOL_FIGURE.match(name))}
        if len(pts) >= 2:
            points, source = pts, report
    if source is None:
        values["restart_curve"], where["restart_curve"] = defaults["restart_curve"], f"default: {CURVE_NOTE}"
        return values, where
    for n, v in points.items():
        if n < 1 or v <= 0:
            raise _fail(source.path, f"replacement_protocol_n{n}_seconds = {v!r}: nodes and seconds must be positive")
    a, b, rms = fit_power(points)
    values["restart_curve"] = ("power", a, b)
    top = max(points)
    at = a * nodes ** b
    where["restart_curve"] = (f"measured: {source.path} ({source.bench}: replacement_protocol_n{{{','.join(map(str, sorted(points)))}}}"
                              f"_seconds), {a:.4g} * N^{b:.2f} (rms {rms:.2f} in log); at {nodes:,} nodes {at:.3f} s"
                              + (f", extrapolated beyond the {top:,} measured" if nodes > top else ""))
    return values, where
