"""The one JSON shape every benchmark writes with ``--json PATH``, and the goodput simulator reads:

    {"bench": "<name>", "version": 1, "created": "<ISO 8601, UTC>",
     "host": {"cpus": N, "loadavg": [1, 5, 15 min], "commit": "<git HEAD>", "command": [argv...]},
     "figures": {"<name>_<unit>": number, ...},
     "runs": [{"name": "...", "finished": "<ISO 8601>", "loadavg": [...], ...}, ...]}   (optional)

Figure names end in their unit (``_seconds``, ``_bytes``, ``_fraction``, ``_count``, ``_ratio``,
``_bytes_per_second``, ``_seconds_per_gb``). Only finite numbers are written; a figure a run
could not measure is left out, never written as 0. ``sentinel_tools/sim/measured.py`` is the reader.

Results are written as they come: a bench with several runs calls :meth:`Results.add` after each
finished one, which rewrites the file (atomically) with every run so far and the figures computed
from them, so a bench killed or timed out keeps what finished. ``host`` records the load average
(at the last write), the git commit of the tree and the exact command, so a figure can be traced.

Every bench takes ``--smoke`` (smallest sizes, a few seconds) and names the figures its smoke run
promises in a module-level ``SMOKE_FIGURES`` tuple; tests/test_bench_smoke.py runs each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

VERSION = 1
REPO = Path(__file__).resolve().parents[1]


def add_json_argument(ap: argparse.ArgumentParser, smoke: bool = True) -> None:
    ap.add_argument("--json", metavar="PATH", type=Path, help="also write the figures as JSON to PATH")
    if smoke and "--smoke" not in ap._option_string_actions:  # a bench may declare its own --smoke
        ap.add_argument("--smoke", action="store_true",
                        help="smallest sizes, a few seconds: proves the bench runs and yields every figure")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    head = r.stdout.strip()
    if r.returncode != 0 or not head:
        return None
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return head + ("+dirty" if dirty else "")


_COMMIT: list[str | None] = []


def host() -> dict:
    if not _COMMIT:
        _COMMIT.append(git_commit())
    return {"cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "commit": _COMMIT[0], "command": [sys.executable, *sys.argv]}


def clean(figures: dict[str, float | int | None]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for name, value in figures.items():
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)):
            raise TypeError(f"figure {name!r} is {type(value).__name__}, not a number")
        if math.isfinite(value):
            out[name] = value
    return out


def report(bench: str, figures: dict[str, float | int | None], runs: list[dict] | None = None) -> dict:
    doc = {"bench": bench, "version": VERSION, "created": _now(), "host": host(), "figures": clean(figures)}
    if runs is not None:
        doc["runs"] = runs
    return doc


def _dump(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write(path: Path | str | None, bench: str, figures: dict[str, float | int | None],
          runs: list[dict] | None = None) -> dict:
    """Writes the report to ``path`` (atomically: a reader never sees half a file) and returns it."""
    doc = report(bench, figures, runs)
    if path is not None:
        _dump(Path(path), doc)
        print(f"figures: {path}")
    return doc


class Results:
    """Each finished run appended to the JSON as it comes. ``summarise(runs)`` turns the runs so far
    into the figures (medians, ratios); it is called after every run, so the file always holds the
    figures of what finished."""

    def __init__(self, path: Path | str | None, bench: str,
                 summarise: Callable[[list[dict]], dict[str, float | int | None]]) -> None:
        self.path = Path(path) if path is not None else None
        self.bench = bench
        self.summarise = summarise
        self.runs: list[dict] = []

    def add(self, run: dict) -> None:
        self.runs.append({**run, "finished": _now(), "loadavg": [round(x, 2) for x in os.getloadavg()]})
        if self.path is not None:
            _dump(self.path, report(self.bench, self.summarise(self.runs), self.runs))

    def finish(self) -> dict:
        return write(self.path, self.bench, self.summarise(self.runs), self.runs)
