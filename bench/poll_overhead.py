"""Daemon overhead: what one poll costs in CPU, part by part, and what a whole daemon costs.

1. **Profile of one poll** (in-process, CPU time: ``time.process_time`` for the process,
   ``time.thread_time`` per part, never wall time), for 8 and 64 simulated GPUs: the simulated NVML
   backend (which spends what a real NVML call costs, ``--nvml-call-us``, cited in
   ``sentinel.sources.simulated.NVML_CALL_SECONDS``), and the daemon's own parts: the NVML source
   (deadline workers, readings), the rules (``Policy.decide``), the state (status.json, and the
   loop's bookkeeping: channel, migration, job health), the metrics (the view and its rendering).
   The daemon's own part is the process's CPU less the backend's and less the profile's own timing
   around each backend call (``profiler``, calibrated on a call that does nothing).
2. **An Xid storm**: 1,000 Xid records a second into the kernel-log reader (a FIFO standing in for
   /dev/kmsg, fed by a separate process) while the real loop (``Daemon.run``) polls at 1 Hz; the
   share of a core the daemon used, against the same loop without the storm, and whether every Xid
   was counted (none lost, none dropped before the policy saw it).
3. A real ``sentinel run --simulate`` process measured from /proc: CPU per poll at 1 Hz, RSS and
   scrape latency, and what one scrape costs a fleet (series and bytes per node and per GPU,
   extrapolated to 2,048 nodes) for the default export (``[metrics] detail = "fleet"``) and the
   opt-in ``"full"`` one; first, NVML device calls per GPU per poll, one call per field and counter
   against batched nvmlDeviceGetFieldValues, counted in-process over the simulated backend.

    python bench/poll_overhead.py [--seconds 20] [--gpus 8 64] [--detail fleet full] [--polls 200]
                                  [--storm-seconds 60] [--storm-rate 1000] [--nvml-call-us 22.5]
                                  [--json out.json] [--smoke]

``--smoke``: 8 GPUs, fleet detail, one 2 s window, 20 profiled polls, a 3 s storm.
"""

from __future__ import annotations

import argparse
import gzip
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _poll_profile  # noqa: E402
import _report  # noqa: E402
from sentinel.sources import simulated  # noqa: E402
from sentinel.sources.simulated import CountingNvml  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
FLEET_NODES = 2048


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int, encoding: str = "identity") -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept-Encoding": encoding})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read()


def cardinality(port: int, gpus: int) -> dict[str, float]:
    """Series and bytes of one scrape (text format, as curl gets it; gzip, as Prometheus does)."""
    body = scrape(port)
    zipped = scrape(port, "gzip")
    if zipped[:2] == b"\x1f\x8b":
        assert len(gzip.decompress(zipped)) > 0
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {
        "series": series,
        "series_per_gpu": series / gpus,
        "scrape_bytes": len(body),
        "scrape_bytes_per_gpu": len(body) / gpus,
        "scrape_gzip_bytes": len(zipped),
        "fleet_nodes": FLEET_NODES,
        "fleet_series": series * FLEET_NODES,
        "fleet_scrape_mb": len(body) * FLEET_NODES / 1e6,
        "fleet_scrape_gzip_mb": len(zipped) * FLEET_NODES / 1e6,
    }


def nvml_calls(gpus: int, batch: bool, polls: int = 5) -> float:
    """NVML device calls per GPU per poll, steady state (after the start-up probe)."""
    from sentinel.sources.nvml import NvmlSource

    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "gpus.json"
        simulated.write_state(state, simulated.healthy_state(gpus))
        counted = CountingNvml(simulated.SimulatedNvml(state))
        src = NvmlSource(counted, deadline_seconds=5.0, batch=batch)
        src.start()
        try:
            src.poll()
            counted.calls = 0
            for _ in range(polls):
                src.poll()
            return counted.calls / gpus / polls
        finally:
            src.close()


def measure(gpus: int, seconds: float, detail: str = "fleet") -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        state = Path(d) / "gpus.json"
        simulated.write_state(state, simulated.healthy_state(gpus))
        config = Path(d) / "sentinel.toml"
        config.write_text(f'[metrics]\ndetail = "{detail}"\n')
        runtime = tempfile.TemporaryDirectory(dir=_poll_profile.RUNTIME_ROOT)  # a tmpfs, as /run/sentinel is
        run = Path(runtime.name) / "run"
        proc = subprocess.Popen(
            [sys.executable, "-m", "sentinel", "run", "--simulate", str(state), "--runtime-dir", str(run),
             "--state-dir", str(Path(d) / "state"), "--config", str(config),
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
            window = min(5.0, seconds)
            for _ in range(max(1, int(seconds // window))):
                c0, t0 = cpu_seconds(proc.pid), time.monotonic()
                time.sleep(window)
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
                "detail": detail,
                **cardinality(port, gpus),
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
            runtime.cleanup()


SMOKE_FIGURES = tuple(f"profile_8gpu_{part}_ms" for part in (*_poll_profile.PARTS, "daemon", "total")) + (
    "storm_core_percent", "storm_daemon_core_percent", "storm_quiet_daemon_core_percent", "storm_records_sent_count",
    "storm_xids_counted_count", "storm_records_lost_count") + ("nvml_calls_per_gpu_poll_before_count", "nvml_calls_per_gpu_poll_after_count",
                 "nvml_calls_per_gpu_poll_reduction_ratio", "cpu_per_poll_8gpu_fleet_ms", "core_8gpu_fleet_percent",
                 "rss_8gpu_fleet_mb", "scrape_p50_8gpu_fleet_ms", "scrape_8gpu_fleet_bytes", "series_8gpu_fleet_count",
                 "fleet_scrape_8gpu_fleet_mb")


def profile_and_storm(args: argparse.Namespace) -> dict[str, float]:
    """The per-part profile of one poll and the Xid storm (bench/_poll_profile.py), printed."""
    cost = args.nvml_call_us / 1e6
    figures: dict[str, float] = {}
    print(f"One poll, CPU ms by part ({args.polls} polls, one scrape every {args.scrape_every}; the simulated NVML "
          f"spends {args.nvml_call_us:g} us a call, as a real one does):")
    cols = ("backend", "nvml_source", "rules", "state", "metrics", "profiler")
    print(f"{'GPUs':>5} " + " ".join(f"{c.replace('_', ' '):>12}" for c in cols) + f" {'daemon own':>11} {'total':>8} "
          f"{'target':>8}")
    for gpus in args.profile_gpus:
        r = _poll_profile.profile(gpus, args.polls, cost, scrape_every=args.scrape_every)
        target = 2.0 if gpus <= 8 else 10.0 if gpus <= 64 else float("nan")
        print(f"{gpus:>5} " + " ".join(f"{r[c]:>12.2f}" for c in cols) + f" {r['daemon']:>11.2f} {r['total']:>8.2f} "
              f"{'<= ' + format(target, 'g'):>8}")
        figures.update({f"profile_{gpus}gpu_{k}_ms": v for k, v in r.items()})
    print("  backend: the simulated NVML calls (not the daemon's); nvml source: deadline workers and readings; rules: "
          "Policy.decide; state: status.json and the loop's bookkeeping; metrics: the view, and the render a scrape "
          "does; profiler: this profile's timing around each backend call (calibrated; not the daemon's)\n")
    s = _poll_profile.storm(8, args.storm_rate, args.storm_seconds, cost)
    print(f"Xid storm, 8 GPUs polled at 1 Hz, {args.storm_rate:,.0f} Xid records/s for {args.storm_seconds:g} s into the "
          f"kernel-log reader: the daemon {s['storm_daemon_percent']:.2f} % of a core ({s['storm_percent']:.2f} % with the "
          f"simulated backend; quiet: {s['quiet_daemon_percent']:.2f} %); target <= 5 %")
    print(f"  {s['sent']:,} records sent, {s['counted']:,} Xids counted by the policy, {s['lost']:,.0f} records lost "
          f"before the reader saw them\n")
    figures.update({"storm_core_percent": s["storm_percent"], "storm_daemon_core_percent": s["storm_daemon_percent"],
                    "storm_quiet_daemon_core_percent": s["quiet_daemon_percent"], "storm_records_sent_count": s["sent"],
                    "storm_xids_counted_count": s["counted"], "storm_records_lost_count": s["lost"]})
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="CPU measuring time per row (5 s windows)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64], help="simulated GPUs per node")
    ap.add_argument("--detail", nargs="+", choices=("fleet", "full"), default=["fleet", "full"],
                    help="[metrics] detail: fleet (the default export) and/or full (every link and state)")
    ap.add_argument("--polls", type=int, default=200, help="polls profiled per GPU count")
    ap.add_argument("--profile-gpus", type=int, nargs="+", default=[8, 64], help="GPU counts profiled")
    ap.add_argument("--scrape-every", type=int, default=15, help="polls between scrapes in the profile (Prometheus at 15 s)")
    ap.add_argument("--nvml-call-us", type=float, default=simulated.NVML_CALL_SECONDS * 1e6,
                    help="CPU microseconds one simulated NVML call spends (default: a real call's, cited in "
                    "sentinel/sources/simulated.py)")
    ap.add_argument("--storm-seconds", type=float, default=60.0, help="length of the Xid storm")
    ap.add_argument("--storm-rate", type=float, default=1000.0, help="Xid records a second in the storm")
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.gpus, args.detail = 2.0, [8], ["fleet"]
        args.polls, args.profile_gpus, args.storm_seconds = 20, [8], 3.0
    figures = profile_and_storm(args)
    before, after = nvml_calls(8, batch=False), nvml_calls(8, batch=True)
    print(f"NVML calls per GPU per poll (8 simulated H100s, 18 NVLink links each): {before:.1f} one call per field "
          f"and counter, {after:.1f} batched (nvmlDeviceGetFieldValues), {before / after:.1f}x fewer; target <= 10\n")
    rows = [measure(n, args.seconds, detail) for n in args.gpus for detail in args.detail]
    print(f"{'GPUs':>5} {'detail':>6} {'CPU ms/poll':>12} {'% of 1 core':>12} {'RSS MB':>8} {'scrape p50 ms':>14} "
          f"{'scrape max ms':>14} {'scrape KB':>10}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['detail']:>6} {r['cpu_ms_per_poll']:>12.2f} {r['core_percent']:>12.2f} {r['rss_mb']:>8.1f} "
              f"{r['scrape_p50_ms']:>14.2f} {r['scrape_max_ms']:>14.2f} {r['scrape_kb']:>10.1f}")
    print(f"\nOne scrape (KB = 1024 bytes; text format, and gzip as Prometheus asks for it), and {FLEET_NODES:,} such nodes:")
    print(f"{'GPUs':>5} {'detail':>6} {'series':>7} {'per GPU':>8} {'KB':>7} {'KB/GPU':>7} {'gzip KB':>8} "
          f"{'series @' + format(FLEET_NODES, ','):>15} {'MB/round':>9} {'gzip MB':>8}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['detail']:>6} {r['series']:>7} {r['series_per_gpu']:>8.1f} {r['scrape_bytes'] / 1024:>7.1f} "
              f"{r['scrape_bytes_per_gpu'] / 1024:>7.2f} {r['scrape_gzip_bytes'] / 1024:>8.1f} {r['fleet_series']:>15,} "
              f"{r['fleet_scrape_mb']:>9.1f} {r['fleet_scrape_gzip_mb']:>8.1f}")
    print("targets: <= 1 % of one core for 8 GPUs at 1 Hz; RSS <= 60 MB; "
          "default export <= 40 series per GPU and <= 30 KB per scrape for 8 GPUs")
    figures.update({"nvml_calls_per_gpu_poll_before_count": before, "nvml_calls_per_gpu_poll_after_count": after,
                    "nvml_calls_per_gpu_poll_reduction_ratio": before / after})
    for r in rows:
        tag = f"{r['gpus']}gpu_{r['detail']}"
        figures.update({f"cpu_per_poll_{tag}_ms": r["cpu_ms_per_poll"], f"core_{tag}_percent": r["core_percent"],
                        f"rss_{tag}_mb": r["rss_mb"], f"scrape_p50_{tag}_ms": r["scrape_p50_ms"],
                        f"scrape_{tag}_bytes": r["scrape_bytes"], f"series_{tag}_count": r["series"],
                        f"fleet_scrape_{tag}_mb": r["fleet_scrape_mb"]})
    _report.write(args.json, "poll_overhead", figures)


if __name__ == "__main__":
    main()
