"""``sentinel drill --rdzv-backend sentinel-etcd``: the job's rendezvous on a 3-member etcd.

Loopback: three members on loopback ports. ``--hosts netns``: one member on each of the first
three node hosts (``node0``..``node2``; the store and scheduler hosts when there are fewer
nodes), so a host that powers off takes its member with it. Every member serves TLS only with
the job's own CA (:mod:`sentinel.etcd_pki`, made in the drill's work directory) and requires the
job's client certificate. Before a fault, leadership is moved to the victim's member (etcd's own
MoveLeader), so ``--fault power-off`` loses the leader with the victim; the report names the
leader before and after the fault and which members still answer.

On netns the drill itself (outside every host) cannot reach the members: its queries run as
``python -m sentinel_tools.drill_etcd probe`` on a host that stays up (the scheduler's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from sentinel.etcd_pki import JobPKI, make_job_pki
from sentinel_tools.etcd_cluster import EtcdCluster
from sentinel_tools.harness import DrillError, progress

BACKEND = "sentinel-etcd"


def member_hosts(host_names: list[str], avoid: tuple[str, ...] = ()) -> list[str]:
    """Three hosts for the members: node hosts first, then the others; none on ``avoid`` (the
    victims of ``--fault power-off-leader-replacing``: the leader is lost in the round, not with them)."""
    host_names = [h for h in host_names if h not in avoid]
    nodes = [h for h in host_names if h.startswith("node")]
    return (nodes + [h for h in host_names if h not in nodes])[:3]


class DrillEtcd:
    """The drill's etcd cluster; ``probe_on`` wraps a command to run on a host that reaches it."""

    def __init__(self, work: Path, names: list[str], addresses: dict[str, str] | None = None,
                 run_on: Callable[[str, list[str]], list[str]] | None = None,
                 probe_on: Callable[[list[str]], list[str]] | None = None) -> None:
        hosts = {n: [addresses[n]] if addresses else [] for n in names}
        self.pki: JobPKI = make_job_pki(work / "etcd-pki", "drill", hosts)
        self.cluster = EtcdCluster(work, names, pki=self.pki, addresses=addresses, run_on=run_on)
        self.probe_on = probe_on

    def start(self, timeout: float) -> None:
        if self.probe_on is None:
            self.cluster.start(timeout)
            return
        for m in self.cluster.members.values():
            self.cluster._spawn(m)
        out = self.probe("--wait", str(timeout))
        if not out.get("leader"):
            self.cluster.stop()
            raise DrillError(f"etcd did not elect a leader within {timeout:g} s: {out}")

    def rdzv_conf(self) -> str:
        return f"cacert={self.pki.cacert},cert={self.pki.client_cert},key={self.pki.client_key},"

    def endpoint(self) -> str:
        return self.cluster.endpoint()

    def procs(self) -> list[subprocess.Popen]:
        return [m.proc for m in self.cluster.members.values() if m.proc is not None]

    def probe(self, *extra: str) -> dict[str, Any]:
        """Members, leader and reachability, asked from where the job stands."""
        argv = [sys.executable, "-m", "sentinel_tools.drill_etcd", "probe", "--endpoints", self.endpoint(),
                "--cacert", str(self.pki.cacert), "--cert", str(self.pki.client_cert), "--key",
                str(self.pki.client_key), *extra]
        if self.probe_on is not None:
            argv = self.probe_on(argv)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        try:
            return json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": (r.stderr or r.stdout).strip()[-500:]}

    def lead_from(self, member: str) -> dict[str, Any]:
        """Move leadership to ``member`` (the victim's): etcd's MoveLeader, then checked."""
        out = self.probe("--move-leader", member)
        progress(f"etcd leader: {out.get('leader')} (asked for {member})")
        return out

    def stop(self) -> None:
        self.cluster.stop()


def _probe(args: argparse.Namespace) -> dict[str, Any]:
    import time

    from trainer.etcd_store import EtcdStore, EtcdTLS, parse_endpoints

    store = EtcdStore(parse_endpoints(args.endpoints), tls=EtcdTLS(args.cacert, args.cert, args.key),
                      request_seconds=2.0, failover_seconds=2.0)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            if args.move_leader:
                store.move_leader(args.move_leader)
            members = store.members()
            leader = next((m["name"] for m in members if m["leader"]), None)
            if leader or time.monotonic() >= deadline:
                return {"leader": leader, "members": members}
        except RuntimeError as exc:
            if time.monotonic() >= deadline:
                return {"leader": None, "error": str(exc)}
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.drill_etcd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe", help="print the members, the leader and who answers, as JSON")
    p.add_argument("--endpoints", required=True)
    for name in ("cacert", "cert", "key"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--wait", type=float, default=0.0, help="until a leader is known, at most this long")
    p.add_argument("--move-leader", default="", help="first make this member the leader")
    args = ap.parse_args(argv)
    print(json.dumps(_probe(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
