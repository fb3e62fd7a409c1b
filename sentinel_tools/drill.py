"""`sentinel drill`: the whole path on one machine, no GPU.

A rendezvous store (a c10d TCPStore, or etcd with ``--rdzv-backend etcd-v2``), N "nodes" — each
a Sentinel daemon with its own simulated GPUs, runtime and state directories and metrics port,
plus an elastic agent running ``trainer/train.py`` — and S spare nodes. With ``--agent warm``
(the default) every agent is ``python -m trainer.elastic`` under ``sentinel launch``, and a spare's
agent is started at once with ``--warm``: torch and the training module imported, forkserver up,
*outside* the rendezvous until the migration admits it (``sentinel admit``: a spare inside the
rendezvous plus any rank crash starts an endless 3-nodes-for-2-slots re-rendezvous loop). With
``--agent torchrun`` the agents are plain torchrun and spares are cold (the agent starts only
when a migration begins): the "before" of ``bench/migration.py``. A fault is
injected at step K into one node's simulated GPU; the timeline of every stage is printed; the
exit status is 0 only when the job finished with a spare in place of the failed node and no
step was lost (``--verify`` also compares the final parameters bitwise with an uninterrupted
run).

The parts: :mod:`sentinel_tools.drill_cluster` (the nodes and the drill's course),
:mod:`sentinel_tools.faults` (one module per fault, with its verdict),
:mod:`sentinel_tools.drill_report` (the timeline, the figures, the printed report),
:mod:`sentinel_tools.harness` and :mod:`sentinel_tools.ports` (waits, processes, ports). This
module is the command: its options, ``run_drill`` and the ``claim-spare`` helper.

This module never imports torch: the job runs in torchrun subprocesses.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from sentinel_tools import drill_report, faults
from sentinel_tools.drill_cluster import NO_NODE_WAIT_SECONDS, SPARE_CALL_WAIT_SECONDS, Drill, Node, claim_spare
from sentinel_tools.drill_report import Timeline, cached_reference, print_timeline
from sentinel_tools.harness import PROGRESS_EVERY, DrillError, alive, descendants, progress, repo_root, wait
from sentinel_tools.ports import PORT_RESERVATION_SECONDS, PORT_RESERVATIONS, free_port, free_ports

DEFAULT_NODES = 2

# the names other modules and tests import from here, where they lived before the split
__all__ = ["FAULTS", "TRAINERS", "NO_NODE_WAIT_SECONDS", "PORT_RESERVATIONS", "PORT_RESERVATION_SECONDS", "PROGRESS_EVERY",
           "SPARE_CALL_WAIT_SECONDS", "Drill", "DrillError", "Node", "Timeline", "add_arguments", "alive",
           "cached_reference", "claim_spare", "descendants", "free_port", "free_ports", "main", "print_timeline",
           "progress", "repo_root", "run_drill", "wait"]

FAULTS = {name: f.description for name, f in faults.FAULTS.items()}
# the jobs a drill runs, and the faults each supports (the hang and slow faults need trainer/train.py's
# drill hook; the Lightning job is a stock script)
TRAINERS = {"reference": set(FAULTS), "lightning": {"xid79", "kill"}, "torchtitan": {"xid79", "kill"}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=None,
                   help=f"nodes of the job (default {DEFAULT_NODES}; 3 for --fault slow-link: two nodes share their "
                        "one link, and it takes a third to tell which end is slow)")
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--procs-per-node", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=2, help="simulated GPUs per node")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--interval-steps", type=int, default=10, help="periodic disk snapshots (the last resort)")
    p.add_argument("--memory-interval-steps", type=int, default=1,
                   help="in-memory snapshots with a peer replica every N steps (0: disk only)")
    p.add_argument("--migrate-ack", choices=("durable", "memory"), default="durable",
                   help="the ranks acknowledge a migrate snapshot once on disk (durable), or once in memory and "
                        "replicated (memory; on disk still when every copy of a shard would leave)")
    p.add_argument("--trainer", choices=sorted(TRAINERS), default="reference",
                   help="the job: reference (trainer/train.py, our own loop), lightning (examples/lightning_job.py, a "
                        "stock Lightning script with SentinelCallback) or torchtitan (examples/torchtitan_job.py: "
                        "torchtitan's CheckpointManager and state objects); --fault xid79 or kill; docs/integrations.md")
    p.add_argument("--fault", choices=sorted(FAULTS), default="xid79")
    p.add_argument("--at-step", type=int, default=25)
    p.add_argument("--hang-mode", choices=["stop", "skip"], default="stop",
                   help="--fault hang: SIGSTOP one rank (stop) or make it never enter the collective (skip)")
    p.add_argument("--slow-factor", type=float, default=1.5, help="--fault slow: the node's ranks compute this much slower")
    p.add_argument("--handover-seconds", type=float, default=5.0,
                   help="the daemons' [job] handover_seconds: this drill's hand-over cost (bench/migration.py measures "
                        "about 1-2 s on one machine)")
    p.add_argument("--victims", type=int, default=1, help="fault this many nodes at the same moment")
    p.add_argument("--kill-spare", action="store_true", help="also kill the first spare as it starts (it dies mid-migration)")
    p.add_argument("--fail-snapshot", action="store_true",
                   help="the disk is full when the migrate snapshot is written (root: a small tmpfs is filled)")
    p.add_argument("--min-nodes", type=int, default=0, help="--nnodes minimum (default: --nodes)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--agent", choices=["warm", "torchrun"], default="warm",
                   help="warm: python -m trainer.elastic, preloaded forkserver, warm spares, graceful leave;"
                        " torchrun: plain torchrun and cold spares (the before)")
    p.add_argument("--rdzv-backend", choices=["c10d", "etcd-v2", "sentinel", "sentinel-etcd"], default=None,
                   help="c10d: a standalone TCPStore; etcd-v2: a local etcd (Debian etcd-server) on loopback; "
                        "sentinel: rank-preserving slots on the standalone TCPStore (--agent warm only); "
                        "sentinel-etcd: the same slots on a 3-member etcd with TLS client certificates (one member "
                        "per node host with --hosts netns; the victim's member is made the leader before the fault). "
                        "Default: c10d; sentinel for --fault partition (its generations fence the cut-off host) and "
                        "for --fault kill and rank-crash with --agent warm (the survivors' own connection errors "
                        "tell a dead node within a second, and a crashed rank's live node is never declared: "
                        "docs/rendezvous.md), and for power-off (the waiting spare tells a silent host)")
    p.add_argument("--silence-window", type=float, default=None, metavar="S",
                   help="the slot rendezvous's silence window (--rdzv-conf silence_window; default 1 s): a host "
                        "whose agent answers no probe of the waiting spare for S s is vacant; below the largest "
                        "round trip of a live host it evicts that host (docs/rendezvous.md)")
    p.add_argument("--start-method", choices=["spawn", "fork", "forkserver"], default="spawn",
                   help="torchrun worker start method (--agent torchrun; a -m module ignores it)")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--verify", action="store_true", help="also run uninterrupted and compare final parameters bitwise")
    p.add_argument("--reference-cache", metavar="DIR",
                   help="--verify: keep the uninterrupted run's final state in DIR and reuse it for the same world size, "
                        "steps and trainer code (drills of one job verify against one run; the test suite shares one)")
    p.add_argument("--json", action="store_true", help="print the machine-readable result")
    p.add_argument("--workdir", help="keep everything here (default: a temporary directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--topology", type=Path, metavar="FILE",
                   help="a topology file (Slurm topology.conf syntax, or TOML [nodes.<name>] nvlink/switches/rack/power, "
                        "docs/topology.md) naming node0.. and spare0..: the nearest spare is admitted, the timeline shows "
                        "its distance, the memory tier keeps each replica outside its holder's rack")
    p.add_argument("--hosts", choices=["loopback", "netns"], default="loopback",
                   help="loopback: every node a set of processes of this machine; netns: every node, spare and the "
                        "store a host of its own (root: network and mount namespaces on one bridge, 198.18.0.0/24, "
                        "private /dev/shm and /run/sentinel), needed by the host faults (docs/drill.md)")
    p.add_argument("--link-rate", default="20mbit", help="--fault slow-link: the victim host's link rate (tc tbf syntax)")
    p.add_argument("--scheduler", choices=["local", "slurm"], default="local",
                   help="slurm: run the job through a real Slurm cluster started here (root; slurm-wlm, munge): "
                        "the failed node is drained in Slurm, the spare comes from the job's allocation")
    p.add_argument("--slurm-conf", type=Path, metavar="PATH",
                   help="--scheduler slurm: use the running cluster of this slurm.conf (nodes node1..node4, idle) "
                        "instead of starting one; it is left running, with node4 drained by the admin check")

    p.add_argument("--user", default="",
                   help="with --scheduler slurm: submit the job as this ordinary user, as on a real cluster (the "
                        "daemons stay root; the job's launchers register with them)")
    p.add_argument("--job-python", default="",
                   help="the interpreter the job runs (default: this one); --user needs one that user can run")


def fault_defaults(args: argparse.Namespace) -> str:
    """The sizes and backend the fault needs where the command line left them out (``--nodes``:
    2, or the fault's minimum; ``--rdzv-backend``: c10d, or the fault's); the one-line error when
    the command line asks for less, else ""."""
    fault = faults.get(args.fault)
    if args.nodes is None:
        args.nodes = max(DEFAULT_NODES, fault.min_nodes)
    elif args.nodes < fault.min_nodes:
        return f"--fault {args.fault} needs --nodes {fault.min_nodes} or more ({fault.min_nodes_why})"
    if args.rdzv_backend is None:
        args.rdzv_backend = fault.rdzv_backend or (fault.rdzv_default if args.agent == "warm" else "") or "c10d"
    elif fault.rdzv_backend and args.rdzv_backend.partition("-")[0] != fault.rdzv_backend:  # sentinel-etcd fences too
        return f"--fault {args.fault} needs --rdzv-backend {fault.rdzv_backend} ({fault.rdzv_why})"
    return ""


def run_drill(args: argparse.Namespace) -> int:
    why = fault_defaults(args)
    if why:
        print(f"sentinel drill: {why}", file=sys.stderr)
        return 2
    fault = faults.get(args.fault)
    if args.rdzv_backend.startswith("sentinel") and args.agent != "warm":
        print(f"sentinel drill: --rdzv-backend {args.rdzv_backend} needs --agent warm (plain torchrun does not "
              "register it)", file=sys.stderr)
        return 2
    if args.slurm_conf is not None:
        print("sentinel drill: --slurm-conf needs --scheduler slurm", file=sys.stderr)
        return 2
    window = getattr(args, "silence_window", None)
    if window is not None and (not args.rdzv_backend.startswith("sentinel") or not 0 < window < 3600):
        print("sentinel drill: --silence-window needs a slot rendezvous (--rdzv-backend sentinel, sentinel-etcd) "
              "and 0 < S < 3600", file=sys.stderr)
        return 2
    if getattr(args, "user", ""):
        print("sentinel drill: --user needs --scheduler slurm (the local drill runs its agents as root)", file=sys.stderr)
        return 2
    if args.spares < 1 and not args.min_nodes:
        print("sentinel drill: --spares 0 needs --min-nodes < --nodes (continue on fewer nodes)", file=sys.stderr)
    trainer = getattr(args, "trainer", "reference")
    if args.fault not in TRAINERS[trainer]:
        print(f"sentinel drill: --trainer {trainer} runs --fault {', '.join(sorted(TRAINERS[trainer]))} only",
              file=sys.stderr)
        return 2
    if trainer == "torchtitan":
        args.memory_interval_steps = 0  # the snapshot is torchtitan's checkpoint: no memory tier (docs/integrations.md)
    if fault.needs_hosts and args.hosts != "netns":
        print(f"sentinel drill: --fault {args.fault} is a fault of a whole host: it needs --hosts netns", file=sys.stderr)
        return 2
    if args.hosts == "netns":
        from sentinel_tools.drill_netns import NetnsDrill

        drill: Drill = NetnsDrill(args)
    else:
        drill = Drill(args)
    # a drill stopped by SIGTERM or SIGHUP (a CI job's timeout, a closed terminal) still runs its
    # cleanup: every process it started, and on --hosts netns every namespace and link
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        result = drill.run()
    except DrillError as exc:
        for line in drill_report.rendezvous_stalls(drill):  # who the stuck round waits for, per agent
            print(f"sentinel drill: {line}", file=sys.stderr)
        print(f"sentinel drill: {exc}; logs in {drill.work}", file=sys.stderr)  # the last line says why
        args.keep = True
        return 1
    finally:
        drill.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_timeline(result)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.drill")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("claim-spare")
    c.add_argument("--pool", required=True, type=Path)
    c.add_argument("--for", dest="departed", default="", help="the node the spare replaces")
    c.add_argument("--topology", default="", help="a topology file: the free spare nearest --for is claimed")
    args = ap.parse_args(argv)
    return claim_spare(args.pool, args.departed, args.topology)


if __name__ == "__main__":
    sys.exit(main())
