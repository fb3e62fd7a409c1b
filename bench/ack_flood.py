"""A rank's acknowledgements while daemon.sock is flooded (#47 item 1): how long each ``ack()``
call holds the training step, and how many the daemon never got, with the rank's own ack channel
(a socket pair whose end comes with the request: sentinel/ack_sockets.py, the default) and
without it (over ``daemon.sock``, as before: a rank of an older daemon). The flooder is the job's user (``nobody`` when run as root), sending to daemon.sock as
fast as it can for the whole run; the daemon reads its sockets every ``--daemon-poll`` seconds,
as its loop does (``daemon.poll_interval_seconds``, 1 s by default).

    sudo python bench/ack_flood.py [--requests 5] [--daemon-poll 1.0] [--json out.json] [--smoke]

``--smoke``: 2 requests per case, a 0.2 s daemon poll.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._report import add_json_argument, write  # noqa: E402
from sentinel import procs  # noqa: E402
from sentinel.daemon_endpoint import DaemonEndpoint  # noqa: E402

CASES = ("own_channel", "daemon_sock")
SMOKE_FIGURES = tuple(f"{c}_{f}" for c in CASES for f in ("ack_median_seconds", "ack_max_seconds", "acks_failed_count"))
NOBODY = 65534

RANK = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from sentinel.channel import Ack, RankEndpoint
    ep = RankEndpoint.open(Path(sys.argv[1]))
    print("ready", flush=True)
    while True:
        for r in ep.poll():
            took = []
            for phase in ("staged", "committed"):
                t0 = time.perf_counter()
                ok = ep.ack(Ack(id=r.id, rank=0, step=1, ok=True, phase=phase))
                took.append([ok, time.perf_counter() - t0])
            print(json.dumps([r.id, took]), flush=True)
        time.sleep(0.005)
""")

FLOOD = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    data = b'{"version":1,"type":"ack","id":"flood","rank":0,"step":1,"ok":true}'
    while True:
        try:
            s.sendto(data, sys.argv[1])
        except OSError:
            pass
""")


def as_job_user() -> dict:
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


# nobody cannot run an interpreter under /root: the system one runs the rank and the flooder
PYTHON = "/usr/bin/python3" if os.geteuid() == 0 and os.path.exists("/usr/bin/python3") else sys.executable


def run_case(case: str, requests: int, poll: float) -> list[list]:
    """One rank, one flooder, ``requests`` migrate requests; each request's [[ok, seconds] x 2]."""
    runtime = Path(tempfile.mkdtemp(prefix="sentinel-ackflood-", dir="/tmp"))
    runtime.chmod(0o755)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"}
    ep = DaemonEndpoint(runtime)
    rank = subprocess.Popen([PYTHON, "-c", RANK, str(runtime)], stdout=subprocess.PIPE, text=True, env=env,
                            **as_job_user())
    flooder = None
    out = []
    try:
        assert rank.stdout.readline().strip() == "ready"
        procs.write_agent_record(runtime / "agent.pid", procs.AgentRecord.of(rank.pid))
        ep.ranks()  # daemon.sock opens to the job's group
        flooder = subprocess.Popen([PYTHON, "-c", FLOOD, str(runtime / "daemon.sock")], env=env, **as_job_user())
        time.sleep(0.5)  # the queue is full
        for i in range(requests):
            rid = f"{case}-{i}"
            assert ep.request("migrate", rid, "bench") == 1
            if case == "daemon_sock":
                ep.ack_channels.close()  # the end the rank gets with the request leads nowhere: daemon.sock
            line = ""
            while not line:  # the daemon's loop: read every `poll` seconds until the rank answered
                ep.poll_acks()
                time.sleep(poll)
                line = rank.stdout.readline() if _ready(rank.stdout) else ""
            got, took = json.loads(line)
            assert got == rid
            out.append(took)
            ep.poll_acks()
    finally:
        for p in (flooder, rank):
            if p is not None:
                p.kill()
                p.wait()
        ep.close()
        shutil.rmtree(runtime, ignore_errors=True)
    return out


def _ready(stream) -> bool:
    import select

    return bool(select.select([stream], [], [], 0)[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--daemon-poll", type=float, default=1.0)
    add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.daemon_poll = 2, 0.2
    figures: dict[str, float | int | None] = {}
    print(f"{'acks go to':<14} {'acks':>5} {'failed':>7} {'median ack() s':>15} {'max ack() s':>12}")
    for case in CASES:
        calls = [c for took in run_case(case, args.requests, args.daemon_poll) for c in took]
        seconds = [s for _, s in calls]
        failed = sum(1 for ok, _ in calls if not ok)
        figures.update({f"{case}_ack_median_seconds": statistics.median(seconds), f"{case}_ack_max_seconds": max(seconds),
                        f"{case}_acks_failed_count": failed})
        print(f"{case:<14} {len(calls):>5} {failed:>7} {statistics.median(seconds):>15.6f} {max(seconds):>12.6f}")
    print(f"flooder: the job's user ({'nobody' if os.geteuid() == 0 else 'this user'}); daemon reads every "
          f"{args.daemon_poll} s; load {os.getloadavg()[0]:.2f}")
    write(args.json, "ack_flood", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
