"""`sentinel scan` of a large mixed kernel log: the CPU a health check spends on a 50 MB file.

The log: 99 % benign lines, 1 % driver records. The benign lines are real kernel messages (this
machine's boot capture in tests/corpus/logformats/, and the corpus's look-alikes that start like a
catalog entry, one line in twenty: the hard case) and the driver records are the corpus's real
failure lines; they come in segments of 200 lines, each segment in one of the formats of
tests/test_scan_property.py (dmesg, -T, -r, -x with ISO times, the caller id, syslog, journalctl,
/dev/kmsg, containerd, Talos, bare), as a log gathered from several sources is.

Measured side by side in one run, the median of R runs each: the CPU seconds (user + system) of
`sentinel scan --no-nvml --kmsg FILE --json` as an operator runs it (a process of its own, the
interpreter's start included), and the in-process reading of the same file line by line (the
record-by-record path /dev/kmsg takes) against the default path that passes runs of lines that
cannot matter over in C. Both must report the same findings and counts, or the bench fails.

    python bench/scan_large.py [--mb 50] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from bench._report import add_json_argument, write  # noqa: E402

SMOKE_FIGURES = ("scan_large_cpu_seconds", "scan_large_megabytes", "scan_large_lines_count",
                 "scan_large_line_by_line_cpu_seconds", "scan_large_fast_cpu_seconds", "scan_large_fast_over_line_ratio")


def build(path: Path, megabytes: float, seed: int = 7) -> tuple[int, int]:
    """Write the mixed log; returns (lines, driver records)."""
    from test_scan_property import BOOT, CORPUS, FORMATS, render, splittable

    rng = random.Random(seed)
    lookalikes = [e["text"] for e in CORPUS if not e["kind"] and "\n" not in e["text"]]
    driver = [e["text"] for e in CORPUS if e["kind"]]
    size = lines = records = 0
    with open(path, "w") as out:
        while size < megabytes * 1e6:
            fmt = rng.choice(FORMATS)
            chunk = []
            for i in range(200):
                r = rng.random()
                if r < 0.01:
                    text = rng.choice([d for d in driver if fmt[2] is not None or not fmt[1] or splittable(d)])
                    records += 1
                else:
                    text = rng.choice(lookalikes) if r < 0.06 else rng.choice(BOOT)
                chunk.extend(render(text, fmt, 100.0 + lines * 1e-4 + i * 1e-6))
            body = "\n".join(chunk) + "\n"
            out.write(body)
            size += len(body.encode())
            lines += len(chunk)
    return lines, records


def cli_cpu(path: Path) -> tuple[float, str]:
    """CPU seconds of one `sentinel scan` process, and its JSON report."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "sentinel", "scan", "--no-nvml", "--kmsg", str(path), "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in (0, 1, 2, 3):
        raise SystemExit(f"sentinel scan failed ({r.returncode}): {r.stderr[-500:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r.stdout


class _LineByLine:
    """The file as records one at a time (what /dev/kmsg gives): the path without the C runs."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def readline(self, limit: int) -> bytes:
        return self._f.readline(limit)


def in_process(data: bytes, line_by_line: bool):
    from sentinel import scan, signatures

    result = scan.Result()
    stream = _LineByLine(data) if line_by_line else io.BytesIO(data)
    t0 = time.process_time()
    scan.scan_kernel_log(stream, "bench", result, signatures.default_catalog(), {}, {}, {79: "migrate"})
    return time.process_time() - t0, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--runs", type=int, default=3)
    add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.runs = 2.0, 1
    with tempfile.TemporaryDirectory(prefix="sentinel-scan-large-") as tmp:
        path = Path(tmp) / "mixed.log"
        lines, records = build(path, args.mb)
        data = path.read_bytes()
        cli, fast, slow = [], [], []
        for _ in range(args.runs):
            seconds, report = cli_cpu(path)
            cli.append(seconds)
            f_s, f_r = in_process(data, line_by_line=False)
            s_s, s_r = in_process(data, line_by_line=True)
            fast.append(f_s)
            slow.append(s_s)
            if f_r.findings != s_r.findings or f_r.kernel_log.as_dict() != s_r.kernel_log.as_dict() or f_r.counts != s_r.counts:
                raise SystemExit("the two paths disagree: the fast path is wrong")
        load = os.getloadavg()
    med = {k: statistics.median(v) for k, v in (("cli", cli), ("fast", fast), ("slow", slow))}
    print(f"sentinel scan of a {len(data) / 1e6:.1f} MB mixed log: {lines} lines, {records} driver records "
          f"({records / lines:.1%}), {sum(f_r.counts.values())} findings; median of {args.runs} run(s); "
          f"load average {load[0]:.2f}")
    print(f"| {'path':<44} | {'CPU s':>7} | {'lines/CPU s':>11} |")
    print(f"|{'-' * 46}|{'-' * 9}|{'-' * 13}|")
    for name, key in (("`sentinel scan --kmsg FILE` (its own process)", "cli"), ("in process, runs passed over in C", "fast"),
                      ("in process, line by line (the /dev/kmsg path)", "slow")):
        print(f"| {name:<44} | {med[key]:>7.2f} | {lines / med[key]:>11.0f} |")
    print(f"fast / line by line: {med['fast'] / med['slow']:.2f}x")
    write(args.json, "scan_large", {
        "scan_large_cpu_seconds": med["cli"], "scan_large_megabytes": len(data) / 1e6, "scan_large_lines_count": lines,
        "scan_large_line_by_line_cpu_seconds": med["slow"], "scan_large_fast_cpu_seconds": med["fast"],
        "scan_large_fast_over_line_ratio": med["fast"] / med["slow"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
