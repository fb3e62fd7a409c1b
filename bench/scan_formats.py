"""`sentinel scan` throughput per kernel-log format: the real captures in tests/corpus/logformats/
(dmesg in each time format, journalctl -k in each short mode, syslog forms) repeated to N lines
and classified in-process by the scan's reader and the signature catalog, side by side in one run.
Reports the median of R runs, lines per second, and each format's cost relative to plain `dmesg`.

    python bench/scan_formats.py [--lines 50000] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._report import add_json_argument, write  # noqa: E402
from sentinel import scan, signatures  # noqa: E402

FORMATS = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "logformats"


SMOKE_FIGURES = tuple(f"scan_{p.stem.replace('-', '_').lower()}_lines_per_second" for p in sorted(FORMATS.glob("*.txt")))


def one_run(data: bytes) -> tuple[float, scan.Result]:
    result = scan.Result()
    catalog = signatures.default_catalog()
    t0 = time.perf_counter()
    scan.scan_kernel_log(io.BytesIO(data), "bench", result, catalog, {}, {}, {})
    return time.perf_counter() - t0, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--runs", type=int, default=3)
    add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.lines, args.runs = 2_000, 1
    rows = []
    for path in sorted(FORMATS.glob("*.txt")):
        lines = path.read_bytes().splitlines(keepends=True)
        data = b"".join(lines * (args.lines // len(lines) + 1))
        times = []
        for _ in range(args.runs):
            seconds, result = one_run(data)
            times.append(seconds)
        kl = result.kernel_log
        rows.append((path.stem, kl.lines, kl.unreadable, statistics.median(times)))
    base = next(r for r in rows if r[0] == "dmesg")[3] / next(r for r in rows if r[0] == "dmesg")[1]
    print(f"sentinel scan reader + catalog, {args.lines} lines per format, median of {args.runs} runs")
    print(f"| {'format':<26} | {'lines':>7} | {'unreadable':>10} | {'median s':>8} | {'lines/s':>9} | {'vs dmesg':>8} |")
    print(f"|{'-' * 28}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    figures = {}
    for name, n, bad, seconds in rows:
        per_line = seconds / n
        print(f"| {name:<26} | {n:>7} | {bad:>10} | {seconds:>8.3f} | {n / seconds:>9.0f} | {per_line / base:>7.2f}x |")
        figures[f"scan_{name.replace('-', '_').lower()}_lines_per_second"] = n / seconds
    write(args.json, "scan_formats", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
