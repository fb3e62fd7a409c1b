"""Daemon overhead: CPU per poll cycle, share of one core at 1 Hz, RSS and scrape latency,
for 8 and 64 simulated GPUs. A real `sentinel run --simulate` process is measured from /proc.

    python bench/poll_overhead.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sentinel.sources import simulated  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(gpus: int, seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "gpus.json"
        simulated.write_state(state, simulated.healthy_state(gpus))
        run = Path(d) / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "sentinel", "run", "--simulate", str(state), "--runtime-dir", str(run),
             "--port", "0", "--listen-address", "127.0.0.1", "--no-ebpf"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            end = time.monotonic() + 30
            while not (run / "status.json").exists() and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(2.0)  # past start-up (imports, probing)
            port = json.loads((run / "status.json").read_text())["metrics_port"]
            windows = []  # CPU seconds per wall second, in 5 s windows; the median resists noise
            for _ in range(max(1, int(seconds // 5))):
                c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                time.sleep(5.0)
                windows.append((cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0))
            per_second = statistics.median(windows)
            lat = []
            for _ in range(50):
                s = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    size = len(r.read())
                lat.append(time.perf_counter() - s)
            return {
                "gpus": gpus,
                "cpu_ms_per_poll": per_second * 1000,  # 1 Hz: one poll per second
                "core_percent": per_second * 100,
                "rss_mb": rss_mb(proc.pid),
                "scrape_p50_ms": statistics.median(lat) * 1000,
                "scrape_max_ms": max(lat) * 1000,
                "scrape_kb": size / 1024,
            }
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    rows = [measure(n, args.seconds) for n in (8, 64)]
    print(f"{'GPUs':>5} {'CPU ms/poll':>12} {'% of 1 core':>12} {'RSS MB':>8} {'scrape p50 ms':>14} {'scrape max ms':>14} {'scrape KB':>10}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['cpu_ms_per_poll']:>12.2f} {r['core_percent']:>12.2f} {r['rss_mb']:>8.1f} "
              f"{r['scrape_p50_ms']:>14.2f} {r['scrape_max_ms']:>14.2f} {r['scrape_kb']:>10.1f}")
    print("targets: <= 1 % of one core for 8 GPUs at 1 Hz; RSS <= 60 MB")


if __name__ == "__main__":
    main()
