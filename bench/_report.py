"""The one JSON shape every benchmark writes with ``--json PATH``, and the goodput simulator reads:

    {"bench": "<name>", "version": 1, "created": "<ISO 8601, UTC>", "host": {"cpus": N},
     "figures": {"<name>_<unit>": number, ...}}

Figure names end in their unit (``_seconds``, ``_bytes``, ``_fraction``, ``_count``, ``_ratio``,
``_bytes_per_second``, ``_seconds_per_gb``). Only finite numbers are written; a figure a run
could not measure is left out, never written as 0. ``sentinel_tools/sim/measured.py`` is the reader.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path

VERSION = 1


def add_json_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", type=Path, help="also write the figures as JSON to PATH")


def report(bench: str, figures: dict[str, float | int | None]) -> dict:
    clean: dict[str, float | int] = {}
    for name, value in figures.items():
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, (int, float)):
            raise TypeError(f"figure {name!r} is {type(value).__name__}, not a number")
        if math.isfinite(value):
            clean[name] = value
    return {"bench": bench, "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count()}, "figures": clean}


def write(path: Path | str | None, bench: str, figures: dict[str, float | int | None]) -> dict:
    """Writes the report to ``path`` (atomically: a reader never sees half a file) and returns it."""
    doc = report(bench, figures)
    if path is not None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        print(f"figures: {path}")
    return doc
