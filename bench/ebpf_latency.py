"""Kernel event -> daemon -> trainer latency, eBPF path vs /dev/kmsg fallback, side by side.

For each path: 1,000 real `NVRM: Xid ... 94` lines written to /dev/kmsg; the time until the
daemon's Xid source has the event, and until a trainer rank's control socket holds the snapshot
request the policy sent (Xid 94 -> snapshot; cooldown 0 for the benchmark). Then the daemon's CPU
while 1,000 kernel lines/s (1 in 10 an Xid) stream in, and its RSS with bcc loaded. Needs root.

    python bench/ebpf_latency.py [--lines 1000] [--json PATH] [--smoke]

The bench process records itself as the node's torchrun agent (``agent.pid``, as `sentinel launch`
writes it), so the daemon trusts its rank socket; without that record every request is refused
(``no_agent``) and no line ever reaches the trainer. ``--smoke``: 20 lines and 1 s of load per path.

``--json`` figures, per path (``ebpf``, ``kmsg``): ``<path>_to_daemon_p50_seconds`` / ``_p99_seconds``,
``<path>_to_trainer_p50_seconds`` / ``_p99_seconds`` (kernel line -> a rank's socket holds the
request: the detection latency the goodput simulator takes), ``<path>_cpu_fraction``,
``<path>_rss_bytes``, ``<path>_delivered_count``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from sentinel import config  # noqa: E402
from sentinel.builder import build_daemon  # noqa: E402
from sentinel.channel import RankEndpoint  # noqa: E402
from sentinel.procs import AgentRecord, write_agent_record  # noqa: E402
from sentinel.sources import simulated  # noqa: E402
from sentinel.sources.xid import XidSource  # noqa: E402

BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
TICK = os.sysconf("SC_CLK_TCK")
SMOKE_FIGURES = tuple(f"{k}_{f}" for k in ("ebpf", "kmsg") for f in (
    "to_daemon_p50_seconds", "to_daemon_p99_seconds", "to_trainer_p50_seconds", "to_trainer_p99_seconds",
    "cpu_fraction", "rss_bytes", "delivered_count"))


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def register_agent(runtime_dir: Path) -> None:
    """This process is the node's torchrun agent, as `sentinel launch` records it: the daemon only
    takes requests from ranks that descend from the recorded agent."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    write_agent_record(runtime_dir / "agent.pid", AgentRecord.of(os.getpid()))


def run_path(use_ebpf: bool, lines: int, kmsg_fd: int, load_seconds: float = 5.0) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="sentinel-bench-"))
    work.chmod(0o755)
    register_agent(work / "run")
    state = work / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(8))
    cfg = config.Config()
    cfg = dataclasses.replace(
        cfg,
        daemon=dataclasses.replace(cfg.daemon, runtime_dir=str(work / "run"), state_dir=str(work / "state"), node_name="bench"),
        metrics=dataclasses.replace(cfg.metrics, port=0, listen_address="127.0.0.1"),
        policy=dataclasses.replace(cfg.policy, cooldown_seconds=0.0),
        ebpf=dataclasses.replace(cfg.ebpf, enabled=use_ebpf, kmsg_fallback=True, rank_signals=False),
    )
    daemon = build_daemon(cfg, simulate=str(state), no_ebpf=not use_ebpf)
    arrivals: list[float] = []
    xid_src = next(s for s in daemon.event_sources if isinstance(s, XidSource))
    push = xid_src.push

    def timed_push(*a, **kw):
        arrivals.append(time.perf_counter())
        push(*a, **kw)

    xid_src.push = timed_push
    daemon.start()
    assert xid_src.path == ("ebpf:printk:console" if use_ebpf else "kmsg"), xid_src.detail
    rank = RankEndpoint.open(work / "run")
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    to_daemon, to_trainer = [], []
    try:
        for i in range(lines):
            bus = BUSES[i % len(BUSES)]
            n = len(arrivals)
            t0 = time.perf_counter()
            os.write(kmsg_fd, f"NVRM: Xid (PCI:0000:{bus}:00): 94, pid={i}, name=bench, Contained: SM (0x1).\n".encode())
            end = t0 + 2.0
            got = False
            while time.perf_counter() < end:
                if rank.poll():
                    got = True
                    break
            t1 = time.perf_counter()
            if len(arrivals) > n:
                to_daemon.append(arrivals[n] - t0)
            if got:
                to_trainer.append(t1 - t0)
        if not to_trainer:
            raise RuntimeError(f"{'eBPF' if use_ebpf else 'kmsg'}: none of {lines} Xid lines reached the trainer's"
                               " socket (is the bench's rank trusted? agent.pid)")
        # CPU at ~1,000 kernel lines/s, 1 in 10 an Xid, for load_seconds
        c0, w0 = cpu_seconds(), time.perf_counter()
        for i in range(int(load_seconds * 1000)):
            line = (f"NVRM: Xid (PCI:0000:18:00): 13, pid={i}, name=load, Graphics Exception\n" if i % 10 == 0
                    else f"load filler {i}: nothing to see\n")
            os.write(kmsg_fd, line.encode())
            rank.poll()
            time.sleep(max(0.0, w0 + (i + 1) / 1000 - time.perf_counter()))
        rate_cpu = (cpu_seconds() - c0) / (time.perf_counter() - w0)
        rss = rss_mb()
    finally:
        daemon.stop()
        loop.join(timeout=5)
        daemon.close()
        rank.close()
    return {"path": "eBPF (printk:console)" if use_ebpf else "/dev/kmsg fallback", "key": "ebpf" if use_ebpf else "kmsg",
            "n": len(to_trainer),
            "d50": statistics.median(to_daemon) * 1e3, "d99": pct(to_daemon, 0.99) * 1e3,
            "t50": statistics.median(to_trainer) * 1e3, "t99": pct(to_trainer, 0.99) * 1e3,
            "cpu": rate_cpu * 100, "rss": rss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1000)
    _report.add_json_argument(ap)
    args = ap.parse_args()
    load_seconds = 5.0
    if args.smoke:
        args.lines, load_seconds = 20, 1.0
    if os.geteuid() != 0:
        sys.exit("needs root (eBPF, /dev/kmsg)")
    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old = knob.read_text().strip()
    knob.write_text("on\n")  # user-space writes to /dev/kmsg are rate-limited by default
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    results = _report.Results(args.json, "ebpf_latency", figures_of)
    try:
        for use_ebpf in (True, False):  # each path written as it finishes
            results.add(run_path(use_ebpf, args.lines, fd, load_seconds))
    finally:
        os.close(fd)
        knob.write_text(old + "\n")
    print(f"{'path':<24} {'n':>5} {'->daemon p50 ms':>16} {'p99 ms':>8} {'->trainer p50 ms':>17} {'p99 ms':>8} "
          f"{'CPU % @1k lines/s':>18} {'RSS MB':>7}")
    rows = results.runs
    for r in rows:
        print(f"{r['path']:<24} {r['n']:>5} {r['d50']:>16.2f} {r['d99']:>8.2f} {r['t50']:>17.2f} {r['t99']:>8.2f} "
              f"{r['cpu']:>18.1f} {r['rss']:>7.0f}")
    print("(in-process daemon, 8 simulated GPUs; CPU and RSS are the whole process: daemon + load generator;"
          " RSS of the eBPF row includes bcc/LLVM; targets: p99 <= 50 ms to the trainer, RSS <= 200 MB)")
    results.finish()


def figures_of(rows: list[dict]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for r in rows:
        k = r["key"]
        for name, ms in (("to_daemon_p50", "d50"), ("to_daemon_p99", "d99"), ("to_trainer_p50", "t50"), ("to_trainer_p99", "t99")):
            figures[f"{k}_{name}_seconds"] = r[ms] / 1e3
        figures[f"{k}_cpu_fraction"] = r["cpu"] / 100
        figures[f"{k}_rss_bytes"] = round(r["rss"] * 2**20)
        figures[f"{k}_delivered_count"] = r["n"]
    return figures


if __name__ == "__main__":
    main()
