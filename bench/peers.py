"""Sentinel side by side with what users would install instead: torch elastic + DCP checkpoints,
torchft, NVIDIA's resiliency extension (NVRx, in-process restart) and DLRover, on one model
(trainer/train.py's reference transformer, its data order), one world (2 nodes x 2 ranks, gloo on
CPU), the same faults at the same step, interleaved in one run so every system sees the same
machine noise.

    python bench/peers.py [--runs 3] [--faults kill,xid79,rank-crash] [--systems ...] [--json PATH] [--smoke]

Faults (at step --at-step of --steps, each step padded to --step-seconds as `sentinel drill` does):
  kill        SIGKILL every process of node1, no warning; the harness (the scheduler) gives the job
              a fresh node1 at once where the system needs one (torch elastic, torchft: cold
              starts; NVRx and Sentinel keep spares running)
  xid79       a predicted failure (Xid 79 on node1's GPU). Only Sentinel sees it; for every peer
              it is a kill at the same step, and the table marks it "(as kill)"
  rank-crash  node1's first rank raises (Sentinel's drill: SIGKILL of that rank)

Per system and fault (median of the runs that finished): fault -> first step (the first step any
rank logs after the fault; Sentinel's: its first step on the spare, as its drill times it, since a
warned node steps on until its migrate snapshot), steps recomputed (step indices computed twice), degraded steps (steps
committed by fewer data-parallel replicas than the world: torchft goes on without the dead
groups' slices of the batch), and whether the final parameters equal the same system's
uninterrupted run bitwise. Per system, once per round with no fault and no padding: the
steady-state step time against the same loop with no fault tolerance at all (DDP for the peers,
FSDP2 for Sentinel, as trainer.train shards it) and the job's peak resident memory against it.
Sentinel's cells are `sentinel drill --nodes 2 --procs-per-node 2 --spares 1 --agent warm
--rdzv-backend sentinel` (the configuration README.md and docs/rendezvous.md give a job: the warm
agent, warm spare, rank-preserving slot rendezvous that tells a dead node from the survivors' own
connection errors; its memory tier every step, disk snapshots every 10), the same for every fault. How each peer is configured, and from which of its pages:
bench/peer_jobs/*.py and docs/peers.md; torchft_tuned is torchft with the Lighthouse's heartbeat
timeout at 1 s instead of its 5 s default (its quorum timeout that a sudden loss waits for). The peers run from their own virtual environments
(scripts/peers-venvs; $SENTINEL_PEERS_VENVS, default /var/cache/sentinel-peers); a peer that
cannot start is tried in every round, and its row shows the error line.

Quiet and loaded: each round measures the systems twice, first quiet, then (``--load N``, default
one per two CPUs, 0 with --smoke) beside N busy loops the harness starts itself (a Python process
each spinning on one CPU, ended with the phase and whenever the harness ends; each also ends by
itself once the harness is gone): the faults of --loaded-faults (default kill,xid79, the two the
acceptance compares on), no steady-state runs (the bitwise references are the quiet phase's).
Each phase has its own table, its own load average, and its ratios taken against Sentinel in
the same phase of the same round; the loaded figures are named ``peers_loaded_...``.

``--smoke``: one round of ``kill`` for Sentinel and torch elastic + DCP (and any installed peer
named with --systems), 16 steps, the fault at step 6. --json: bench/_report.py's shape, written
after every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
import _report  # noqa: E402
from peer_jobs import systems  # noqa: E402
from peer_jobs.account import PHASES, account, loss_deviation, losses, slug, summarise  # noqa: E402

ALL_SYSTEMS = ("sentinel", "elastic_dcp", "torchft", "torchft_tuned", "nvrx", "dlrover")
LABELS = {"sentinel": "Sentinel (warm spare, memory tier)", **{n: p.label for n, p in systems.PEERS.items()}}
FAULTS = ("kill", "xid79", "rank-crash")
SMOKE_FIGURES = ("peers_sentinel_kill_fault_to_first_step_seconds", "peers_sentinel_kill_recomputed_steps",
                 "peers_elastic_dcp_kill_fault_to_first_step_seconds", "peers_elastic_dcp_kill_recomputed_steps",
                 "peers_elastic_dcp_kill_bitwise_equal_fraction",
                 "peers_elastic_dcp_over_sentinel_kill_fault_to_first_step_ratio")


def sentinel_cell(fault: str, args: argparse.Namespace, work: Path, reference: dict | None = None) -> dict:
    """One `sentinel drill` of the same world, steps and fault; its progress log read like the peers'."""
    wd = work / "drill"
    argv = [sys.executable, "-m", "sentinel", "drill", "--json", "--nodes", "2", "--procs-per-node", "2",
            "--spares", "1", "--agent", "warm", "--rdzv-backend", "sentinel", "--fault", fault, "--steps", str(args.steps), "--at-step", str(args.at_step),
            "--step-seconds", str(args.step_seconds), "--timeout", str(args.timeout), "--workdir", str(wd),
            "--verify", "--reference-cache", str(args.cache / "sentinel-reference")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout + 300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if not r.stdout.strip().startswith("{"):
        return {"ok": False, "error": (r.stderr.strip().splitlines() or ["no output"])[-1][-240:]}
    d = json.loads(r.stdout)
    events = [json.loads(line) for line in (wd / "progress.jsonl").read_text().splitlines() if line.strip()]
    t_fault = next(e["time"] for e in d["timeline"] if e["stage"] == "fault injected")
    cell = account(events, t_fault, full=4)
    # A warned node keeps stepping until its migrate snapshot: the first step its log shows after an
    # xid79 is one of those (the job did not stop), not the hand-over. Like the peers' figure (their
    # first step after recovering), Sentinel's is its first step on the spare, as the drill times it
    # (the same step as the log's for kill and rank-crash); the log's first step is kept beside it.
    cell["first_logged_step_seconds"] = cell["fault_to_first_step_seconds"]
    if d.get("fault_to_first_step_seconds") is not None:
        cell["fault_to_first_step_seconds"] = cell["fault_to_full_world_seconds"] = d["fault_to_first_step_seconds"]
    cell.update(ok=bool(d["ok"]), injected=fault, bitwise=bool((d.get("verify") or {}).get("bitwise_equal")),
                loss_deviation=loss_deviation(events, (reference or {}).get("losses"), t_fault),
                drill={"fault_to_first_step_seconds": d.get("fault_to_first_step_seconds"),
                       "recomputed_steps": d.get("recomputed_steps")})
    return cell


def peer_cell(peer: systems.Peer, fault: str, args: argparse.Namespace, work: Path, reference: dict | None) -> dict:
    why = peer.available()
    if why:
        return {"ok": False, "error": why}
    run = systems.Run(work, args.steps, args.step_seconds, fault)
    injected = "rank-crash" if fault == "rank-crash" else "kill"
    try:
        peer.launch(run)
        at = lambda: any(e["event"] == "step" and e["step"] >= args.at_step for e in run.events())  # noqa: E731
        if not systems.wait_for(lambda: at() or not run.alive(), args.timeout, run) or not at():
            return {"ok": False, "error": systems.first_error_line(run), "injected": injected}
        if injected == "kill":
            t_fault = time.time()
            run.kill_node("node1")
            peer.replace(run)
        else:
            (run.work / "crash").write_text(f"{peer.crash_rank} {args.at_step + 1}")
            t_fault = None
        done = lambda: run.final.exists() or not run.alive()  # noqa: E731
        systems.wait_for(done, args.timeout, run)
        events = run.events()
        if t_fault is None:
            t_fault = next((e["time"] for e in events if e["event"] == "fault"), None)
        if t_fault is None:
            return {"ok": False, "error": "the rank never raised: " + systems.first_error_line(run), "injected": injected}
        cell = account(events, t_fault, full=4)
        final = json.loads(run.final.read_text()) if run.final.exists() else None
        reference = reference or {}
        cell.update(injected=injected, ok=final is not None,
                    bitwise=final is not None and reference.get("digest") is not None
                    and final["params"] == reference["digest"],
                    loss_deviation=loss_deviation(events, reference.get("losses"), t_fault))
        if final is None:
            cell["error"] = systems.first_error_line(run)
        return cell
    finally:
        run.cleanup()


def steady(system: str, args: argparse.Namespace, work: Path) -> dict:
    """The system with no fault and no padding: step time (median interval of rank 0's steps after
    the first 5), peak resident memory of the whole job, the final digest (the reference)."""
    peer = systems.STEADY[system]
    why = peer.available()
    if why:
        return {"ok": False, "error": why}
    run = systems.Run(work, args.steps, 0.0)
    peak = 0
    try:
        peer.launch(run)
        end = time.monotonic() + args.timeout
        # until the job has written its final digest (NVRx's spares and monitors linger after it) or ended
        while run.alive() and not run.final.exists() and time.monotonic() < end:
            peak = max(peak, run.tree_rss_bytes())
            time.sleep(0.1)
        events = run.events()
        first = sorted({e["step"]: e["time"] for e in events if e["event"] == "step"
                        and e.get("writer", "rank0") in ("rank0", "group0") and e.get("rank", 0) == 0}.items())
        gaps = [b[1] - a[1] for a, b in zip(first, first[1:]) if a[0] >= 5 and b[0] == a[0] + 1]
        final = json.loads(run.final.read_text()) if run.final.exists() else None
        out = {"ok": bool(gaps), "step_seconds": statistics.median(gaps) if gaps else None, "peak_rss_bytes": peak,
               "digest": final["params"] if final else None, "losses": losses(events)}
        if not gaps:
            out["error"] = systems.first_error_line(run)
        return out
    finally:
        run.cleanup()


# a busy loop that ends by itself once the harness (its parent) is gone, whatever killed it
# (the parent's pid is its argument: read at its start, it could already be the one it was handed to)
BUSY_LOOP = ("import os, sys, time\nparent = int(sys.argv[1])\nwhile os.getppid() == parent:\n"
             "    end = time.monotonic() + 0.5\n    while time.monotonic() < end:\n        pass\n")


class BusyLoops:
    """``n`` processes spinning on a CPU each, for a loaded phase; ended on exit, also on failure."""

    def __init__(self, n: int) -> None:
        self.n, self.procs = n, []

    def __enter__(self) -> "BusyLoops":
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())], start_new_session=True,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs = []


def one_round(args: argparse.Namespace, results: _report.Results, refs: dict[str, dict],
              phase: str = "quiet") -> None:
    faults = args.faults if phase == "quiet" else args.loaded_faults
    for system in ["none", "none_fsdp", *args.systems] if args.steady and phase == "quiet" else []:
        if system not in systems.STEADY:
            continue
        with tempfile.TemporaryDirectory(prefix=f"peers-{system}-", dir=args.cache) as d:
            r = steady(system, args, Path(d))
        losses = r.pop("losses", None)  # kept once per system (the reference), not in every round's record
        if r.get("digest"):
            refs.setdefault(system, {"digest": r["digest"], "losses": losses})
        results.add({"kind": "steady", "phase": phase, "system": system, **r})
        print(f"  steady {system}: {r.get('step_seconds')} s/step, peak {r.get('peak_rss_bytes')} B {r.get('error', '')}",
              flush=True)
    for fault in faults:
        for system in args.systems:
            d = Path(tempfile.mkdtemp(prefix=f"peers-{system}-{fault}-", dir=args.cache))
            try:
                if system == "sentinel":
                    cell = sentinel_cell(fault, args, d, refs.get("sentinel"))
                else:
                    cell = peer_cell(systems.PEERS[system], fault, args, d, refs.get(system))
            finally:
                if not args.keep:
                    shutil.rmtree(d, ignore_errors=True)
            results.add({"kind": "cell", "phase": phase, "system": system, "fault": fault, **cell})
            print(f"  {phase} {system} {fault}: " + (f"fault -> first step {cell.get('fault_to_first_step_seconds')} s, "
                                             f"recomputed {cell.get('recomputed_steps')}, bitwise {cell.get('bitwise')}"
                                             if cell.get("ok") else f"FAILED: {cell.get('error')}"), flush=True)


def print_tables(runs: list[dict], figures: dict, load: int) -> None:
    print(f"\nhost: {os.cpu_count()} CPUs")
    for phase, pre in PHASES.items():
        rs = [r for r in runs if r.get("phase", "quiet") == phase]
        if not rs:
            continue
        # the phase's own figures under the plain names, so that one table prints either
        fig = {"peers_" + k[len(pre):]: v for k, v in figures.items() if k.startswith(pre)
               and (pre != "peers_" or not k.startswith("peers_loaded_"))}
        print(f"\n{phase}" + (f" (beside {load} busy loop{'s' if load != 1 else ''})" if phase == "loaded" else "")
              + f": 1-minute load average median {fig.get('peers_load_average_ratio', 0):.1f}, "
              f"{min(r['loadavg'][0] for r in rs):.1f} to {max(r['loadavg'][0] for r in rs):.1f} over its runs")
        print_table(rs, fig)


def print_table(runs: list[dict], figures: dict) -> None:
    faults = [f for f in FAULTS if any(r.get("fault") == f for r in runs)]
    head = f"{'system':<36}" + "".join(f" | {f + ': s / recomputed / degraded / bitwise':<44}" for f in faults)
    print(head + f" | {'step overhead':>13} | {'extra peak MB':>13}")
    for system in dict.fromkeys(r["system"] for r in runs if r["kind"] == "cell"):
        cols = []
        for f in faults:
            p = f"peers_{system}_{slug(f)}_"
            cells = [r for r in runs if r["kind"] == "cell" and r["system"] == system and r["fault"] == f]
            if p + "fault_to_first_step_seconds" in figures:
                as_kill = " (as kill)" if f == "xid79" and system != "sentinel" else ""
                cols.append(f"{figures[p + 'fault_to_first_step_seconds']:.2f} / {figures[p + 'recomputed_steps']:g} / "
                            f"{figures.get(p + 'degraded_steps', 0):g} / "
                            f"{sum(bool(c.get('bitwise')) for c in cells if c.get('ok'))}/{len(cells)}"
                            + (f" (loss dev {figures[p + 'max_loss_deviation']:.1e})" if p + "max_loss_deviation" in figures
                               else "") + as_kill)
            else:
                err = next((c.get("error", "") for c in cells if not c.get("ok")), "not run")
                cols.append(f"not measured: {err[-80:]}")
        ov = figures.get(f"peers_{system}_step_over_baseline_ratio")
        mem = figures.get(f"peers_{system}_extra_peak_rss_bytes")
        print(f"{LABELS.get(system, system):<36}" + "".join(f" | {c:<44}" for c in cols)
              + f" | {(f'{ov:.2f}x' if ov else '-'):>13} | {(f'{mem / 1e6:.0f}' if mem is not None else '-'):>13}")
    for name, v in sorted(figures.items()):
        if name.endswith("_ratio") and "_over_sentinel_" in name:
            print(f"{name:<72} {v:>7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, help="rounds (default 3; 1 with --smoke)")
    ap.add_argument("--faults", help=f"comma-separated, of {','.join(FAULTS)} (default all; kill with --smoke)")
    ap.add_argument("--systems", help=f"comma-separated, of {','.join(ALL_SYSTEMS)} (default all; "
                                      "sentinel,elastic_dcp with --smoke)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--at-step", type=int)
    ap.add_argument("--step-seconds", type=float, default=0.1)
    ap.add_argument("--timeout", type=float, default=300.0, help="per job (s)")
    ap.add_argument("--no-steady", dest="steady", action="store_false",
                    help="skip the no-fault runs (step time, memory; the peers' bitwise reference comes from them)")
    ap.add_argument("--load", type=int, help="busy loops beside the loaded phase (default: one per two CPUs; "
                                          "0 with --smoke); 0: no loaded phase")
    ap.add_argument("--loaded-faults", help="comma-separated: the faults measured again in the loaded phase "
                                            "(default: kill and xid79 where --faults has them)")
    ap.add_argument("--keep", action="store_true", help="keep each faulted job's work directory (logs, progress)")
    ap.add_argument("--cache", type=Path, help="work directory (default: a temporary one)")
    _report.add_json_argument(ap)
    args = ap.parse_args()
    args.runs = args.runs or (1 if args.smoke else 3)
    args.faults = (args.faults or ("kill" if args.smoke else ",".join(FAULTS))).split(",")
    args.systems = (args.systems or ("sentinel,elastic_dcp" if args.smoke else ",".join(ALL_SYSTEMS))).split(",")
    args.steps = args.steps or (16 if args.smoke else 40)
    args.at_step = args.at_step or (6 if args.smoke else 15)
    args.load = args.load if args.load is not None else (0 if args.smoke else max(1, (os.cpu_count() or 2) // 2))
    args.loaded_faults = ([] if args.load <= 0 else args.loaded_faults.split(",") if args.loaded_faults
                          else [f for f in ("kill", "xid79") if f in args.faults])
    # a bench stopped by SIGTERM (measure_all's limit, a CI timeout) still stops every job it started
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    bad = (set(args.faults) - set(FAULTS)) | (set(args.loaded_faults) - set(FAULTS)) | (set(args.systems) - set(ALL_SYSTEMS))
    if bad:
        ap.error(f"unknown {sorted(bad)}")
    with tempfile.TemporaryDirectory(prefix="sentinel-peers-") as tmp:
        args.cache = args.cache or Path(tmp)
        args.cache.mkdir(parents=True, exist_ok=True)
        results = _report.Results(args.json, "peers", summarise)
        refs: dict[str, dict] = {}
        for i in range(args.runs):  # interleaved: every system sees the same machine noise
            print(f"round {i + 1}/{args.runs}", flush=True)
            one_round(args, results, refs)
            if args.loaded_faults:  # the same round again beside the busy loops
                with BusyLoops(args.load):
                    one_round(args, results, refs, "loaded")
        print_tables(results.runs, summarise(results.runs), args.load)
        results.finish()


if __name__ == "__main__":
    main()
