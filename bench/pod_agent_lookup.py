"""What the daemon pays to find a pod's agent: reading the agent record of an agent in the host's pid
namespace, against one in a pid namespace of its own (a pod), first without the remembered
mapping (a scan of /proc) and then with it (the daemon's steady state: the endpoint keeps it).

Runs as root (unshare). Prints medians of --runs reads each, measured interleaved in one run, and
the ratios; --json writes the figures (bench/_report.py).

    python bench/pod_agent_lookup.py --runs 200
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import add_json_argument, write  # noqa: E402
from sentinel import procs  # noqa: E402


SMOKE_FIGURES = ("host_read_seconds", "pod_scan_read_seconds", "pod_remembered_read_seconds", "host_processes_count",
                 "pod_scan_over_host_ratio", "pod_remembered_over_host_ratio")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:  # 20 reads per case: that it runs (tests/test_bench_smoke.py)
        args.runs = 20
    if os.geteuid() != 0:
        print("pod_agent_lookup: needs root (unshare --pid)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sentinel-bench-pod-"))
    # each in a process group of its own, ended as a group: the pod's shell and sleeper (children
    # of unshare) outlived a kill of unshare alone and held the caller's output pipes for 300 s
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    host_agent = subprocess.Popen(["sleep", "300"], **quiet)
    pod = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--", "sh", "-c", "sleep 300 & wait"], **quiet)
    try:
        time.sleep(0.5)
        host_file, pod_file = work / "host.pid", work / "pod.pid"
        procs.write_agent_record(host_file, procs.AgentRecord.of(host_agent.pid))
        shell = int(Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()[0])  # the pod's pid 1
        sleeper = int(Path(f"/proc/{shell}/task/{shell}/children").read_text().split()[0])
        record = procs.AgentRecord.of(sleeper)
        ns_pid = procs.ns_pids(sleeper)[-1]
        # what a launcher inside the pod writes: its own pid there, and the pod's pid namespace
        procs.write_agent_record(pod_file, procs.AgentRecord(ns_pid, record.start_time, record.exe, record.uid,
                                                             record.boot_id, record.pidns))
        assert procs.read_agent_record(pod_file).pid == sleeper
        times: dict[str, list[float]] = {"host": [], "pod_scan": [], "pod_remembered": []}
        mapped: dict = {}
        procs.read_agent_record(pod_file, mapped=mapped)
        for _ in range(args.runs):
            for name, fn in (("host", lambda: procs.read_agent_record(host_file)),
                             ("pod_scan", lambda: procs.read_agent_record(pod_file)),
                             ("pod_remembered", lambda: procs.read_agent_record(pod_file, mapped=mapped))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        nproc = sum(1 for n in os.listdir("/proc") if n.isdigit())
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"agent record read, median of {args.runs} (interleaved); {nproc} processes on this host")
        print(f"{'case':<34} {'median us':>10}")
        print(f"{'host pid namespace':<34} {med['host'] * 1e6:>10.1f}")
        print(f"{'pod, no remembered mapping (scan)':<34} {med['pod_scan'] * 1e6:>10.1f}")
        print(f"{'pod, remembered mapping':<34} {med['pod_remembered'] * 1e6:>10.1f}")
        print(f"ratios: scan / host {med['pod_scan'] / med['host']:.1f}x; "
              f"remembered / host {med['pod_remembered'] / med['host']:.2f}x")
        if args.json:
            write(args.json, "pod_agent_lookup", {
                "host_read_seconds": med["host"], "pod_scan_read_seconds": med["pod_scan"],
                "pod_remembered_read_seconds": med["pod_remembered"], "host_processes_count": nproc,
                "pod_scan_over_host_ratio": med["pod_scan"] / med["host"],
                "pod_remembered_over_host_ratio": med["pod_remembered"] / med["host"]})
    finally:
        for p in (host_agent, pod):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
