"""Migration benchmark: repeated `sentinel drill` runs, interleaved so every path sees the same
machine noise; median and max of each stage, trip -> first step on the spare, lost steps.

Paths, side by side in one run (``lightning`` and ``torchtitan`` only when asked: ``--trainer lightning``
runs warm and lightning):
  warm        Sentinel: predicted fault, migrate snapshot, warm spare (python -m trainer.elastic)
  warm-etcd   the same with torch's etcd-v2 rendezvous on a local etcd (--etcd; Debian etcd-server)
  one3        one victim of a 3-node job (2 warm spares): the baseline for two victims of the same job
  two         two victims at once (3 nodes, 2 warm spares): one membership change
  two-memory  the same with memory-only migrate acks (--migrate-ack memory): the two victims hold
              each other's replica (the ring), so their acks must wait for the disk copy (#47)
  cold        the before: the same predicted migration with plain torchrun and a cold spare
  crash       plain torchrun crash failover: kill -9, no warning, cold spare, periodic snapshot
  kill        Sentinel's sudden loss: kill -9 of a node's agent and workers, no warning, warm spare, memory
              tier, slot rendezvous (the dead node told from the survivors' errors, #48)
  kill-two    two nodes of 3 killed at once (2 warm spares): one membership change
  kill-snap   the kill right after a disk snapshot's step (--at-step 29; snapshots of steps 9, 19, 29, ...):
              its write in flight or just done; the row says in how many drills it was still in flight
  lightning   warm's path for a stock Lightning script with SentinelCallback (examples/lightning_job.py)
  torchtitan  warm's path for torchtitan's CheckpointManager and state objects (examples/torchtitan_job.py)

With ``--hosts netns`` (root) the host faults on namespaced hosts, each beside its loopback
counterpart in the same run, interleaved: ``hosts-xid79`` beside ``loopback-xid79`` (the same
fault), ``hosts-power-off`` beside ``loopback-kill`` (kill -9 of a node's agent and workers,
Sentinel's memory tier: the nearest loopback has to losing a host), ``hosts-partition`` (no
loopback counterpart); its report is bench ``migration_hosts``;
the extra column is the bytes that crossed the bridge into the spare's host after the fault
(the state restored into it plus its training traffic to the end), and
``hosts_over_loopback_xid79_ratio`` / ``hosts_over_loopback_power_off_ratio`` divide the
fault -> first step medians (#41: within 1.5x). ``hosts-power-off-0.3`` (by name in ``--only``)
is the power-off with the slot rendezvous's silence window at 0.3 s instead of its 1 s default
(``hosts_over_loopback_power_off_window_0_3_ratio``): what a fabric with a lower round-trip bound
would get (docs/rendezvous.md, "A host that answers nothing").

    python bench/migration.py [--runs 5] [--interval-steps 10] [--etcd] [--trainer lightning|torchtitan] [--json PATH] [--smoke]

Each drill is appended to the JSON as it finishes (with the figures of every drill so far), so a
run killed or timed out keeps the drills already done. ``--smoke``: one drill each of ``warm`` and
``crash``, 12 steps, the fault at step 4 (drill timeout 600 s: a smoke run checks figures, not speed;
with the default --interval-steps 10 the crash path restarts from step 0: the plain failover with no
snapshot yet, a bound the drill holds even on a loaded host). Arguments the bench does not know
are passed to every drill after its own (a later ``--steps`` wins; tests/test_netns_hosts.py runs
the ``--hosts netns`` smoke at the drill's default length with ``--verify``). Each drill's record
is its ``--json`` result with its exit status ``rc`` (and its stderr's tail, ``error``, when it failed).

--json (bench/_report.py's shape; sentinel_tools/sim/measured.py reads it): medians over the drills
that succeeded. ``migration_*`` is the warm-spare path (``migration_trip_to_first_step_seconds``,
``migration_fault_to_first_step_seconds``, ``migration_lost_steps``, ``migration_ok_fraction``,
``migration_stage_<stage>_seconds`` = each stage's own duration), ``crash_*`` the plain torchrun
crash failover, and ``one_of_three_*``, ``two_victims_*`` (``two_victims_slot_*``: the same on the slot rendezvous, named in --only), ``two_adjacent_memory_ack_*``, ``etcd_migration_*``,
``cold_spare_torchrun_*`` the other paths, ``sudden_kill_*``, ``sudden_kill_two_*``, ``sudden_kill_snapshot_*`` the
sudden losses (with ``*_fault_to_declared_seconds``: until the rendezvous declared the dead node, and
``*_fault_to_spare_workers_seconds``: until the spare's workers started; ``--only kill,kill-two,kill-snap``
alone makes its own report, bench ``migration_sudden``), plus ``*_ratio`` figures, each dividing two medians of this run taken with the same measure:
``plain_failover_over_warm_ratio`` = crash fault -> first step / warm spare fault -> first step;
``cold_torchrun_over_warm_ratio`` = cold spare trip -> first step / warm spare trip -> first step;
``two_victims_over_one_ratio`` = two victims of 3 nodes / one victim of 2 nodes (trip -> first step);
``two_victims_over_one_same_job_ratio`` = two victims / one victim of the same 3-node job (trip -> first
step); ``etcd_over_c10d_ratio`` = etcd-v2 / c10d warm spare (trip -> first step);
``lightning_over_reference_ratio`` (``torchtitan_over_reference_ratio``) = Lightning (TorchTitan) job / our
own loop, warm spare (fault -> first step). The plain torchrun
baselines (``cold``, ``crash``) run without Sentinel's memory tier (``--memory-interval-steps 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

PATHS = {
    "warm": ("Sentinel, warm spare (c10d)", ["--fault", "xid79"]),
    "warm-etcd": ("Sentinel, warm spare (etcd-v2)", ["--fault", "xid79", "--rdzv-backend", "etcd-v2"]),
    "one3": ("Sentinel, 1 victim of 3 nodes", ["--fault", "xid79", "--nodes", "3", "--spares", "2", "--victims", "1"]),
    "two": ("Sentinel, 2 victims, 2 warm spares", ["--fault", "xid79", "--nodes", "3", "--spares", "2", "--victims", "2"]),
    # the same two victims on the rendezvous README.md gives a job (rank-preserving slots: no c10d round)
    "two-slot": ("Sentinel, 2 victims, 2 warm spares, slot rendezvous", ["--fault", "xid79", "--nodes", "3", "--spares", "2",
                                                                         "--victims", "2", "--rdzv-backend", "sentinel"]),
    "two-memory": ("Sentinel, 2 adjacent victims, memory acks", ["--fault", "dbe", "--nodes", "3", "--spares", "2",
                                                                 "--victims", "2", "--migrate-ack", "memory"]),
    # the baselines are plain torchrun as it was before Sentinel: no memory tier (disk snapshots only)
    "cold": ("before: torchrun, cold spare", ["--fault", "xid79", "--agent", "torchrun", "--memory-interval-steps", "0"]),
    "crash": ("plain torchrun crash failover", ["--fault", "kill", "--agent", "torchrun", "--memory-interval-steps", "0"]),
    # sudden losses on Sentinel's path (#48): detection split out (fault -> dead node declared -> spare workers)
    "kill": ("Sentinel, sudden kill -9", ["--fault", "kill"]),
    "kill-two": ("Sentinel, 2 of 3 nodes killed", ["--fault", "kill", "--nodes", "3", "--spares", "2", "--victims", "2"]),
    "kill-snap": ("Sentinel, kill at a disk snapshot", ["--fault", "kill", "--at-step", "29"]),
    # a stock Lightning script with SentinelCallback (examples/lightning_job.py), the same warm-spare path
    "lightning": ("Sentinel + Lightning, warm spare", ["--fault", "xid79", "--trainer", "lightning"]),
    # torchtitan's CheckpointManager and state objects (examples/torchtitan_job.py); no memory tier
    "torchtitan": ("Sentinel + TorchTitan, warm spare", ["--fault", "xid79", "--trainer", "torchtitan"]),
    # --hosts netns: host faults on namespaced hosts, each beside its loopback counterpart (root)
    # (a report of its own, bench "migration_hosts": its loopback figures never stand in for the above)
    "loopback-xid79": ("loopback: Xid 79, warm spare", ["--fault", "xid79"]),
    "hosts-xid79": ("hosts: Xid 79, warm spare", ["--hosts", "netns", "--fault", "xid79"]),
    "loopback-kill": ("loopback: kill -9, memory tier", ["--fault", "kill"]),
    "hosts-power-off": ("hosts: power-off, memory tier", ["--hosts", "netns", "--fault", "power-off"]),
    # the silence rule's window at 0.3 s (a fabric whose round trips stay far below it; docs/rendezvous.md)
    "hosts-power-off-0.3": ("hosts: power-off, 0.3 s silence window", ["--hosts", "netns", "--fault", "power-off",
                                                                        "--silence-window", "0.3"]),
    "hosts-partition": ("hosts: partition, fenced", ["--hosts", "netns", "--fault", "partition"]),
}
HOST_PATHS = ("loopback-xid79", "hosts-xid79", "loopback-kill", "hosts-power-off", "hosts-partition")
BY_NAME = ("warm-etcd", "lightning", "torchtitan", "hosts-power-off-0.3", "two-slot")  # only when named in --only (or --etcd)
FIGURE_PREFIX = {"warm": "migration_", "warm-etcd": "etcd_migration_", "one3": "one_of_three_", "two": "two_victims_", "two-slot": "two_victims_slot_",
                 "two-memory": "two_adjacent_memory_ack_",
                 "lightning": "lightning_migration_", "torchtitan": "torchtitan_migration_",
                 "cold": "cold_spare_torchrun_", "crash": "crash_", "loopback-xid79": "loopback_xid79_",
                 "kill": "sudden_kill_", "kill-two": "sudden_kill_two_", "kill-snap": "sudden_kill_snapshot_",
                 "loopback-kill": "loopback_kill_",
                 "hosts-xid79": "hosts_xid79_", "hosts-power-off": "hosts_power_off_",
                 "hosts-power-off-0.3": "hosts_power_off_window_0_3_",
                 "hosts-partition": "hosts_partition_"}


def drill(interval: int, extra: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--json", "--interval-steps", str(interval), *extra],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    if not r.stdout.strip().startswith("{"):
        return {"ok": False, "rc": r.returncode, "error": r.stderr[-500:]}
    out = json.loads(r.stdout)
    out["rc"] = r.returncode
    if not out.get("ok"):
        out["error"] = r.stderr[-1500:]
    return out


def median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def stage_durations(rows: list[dict]) -> dict[str, list[float]]:
    """Each stage's time since the trip (its own clock start; a sudden loss has none: since the
    fault), per run."""
    out: dict[str, list[float]] = {}
    for r in rows:
        trip = next((e["time"] for e in r["timeline"] if e["stage"] == "detected"), None)
        if trip is None and r.get("fault_to_declared_seconds") is not None:
            trip = next((e["time"] for e in r["timeline"] if e["stage"] == "fault injected"), None)
        for e in r["timeline"]:
            if trip is not None and e["stage"] not in ("fault injected", "job finished"):
                out.setdefault(e["stage"], []).append(e["time"] - trip)
    return out


def slug(stage: str) -> str:
    return stage.replace(" ", "_").replace("-", "_")


SMOKE_ARGS = ["--steps", "12", "--at-step", "4", "--timeout", "600"]  # a loaded CI host: bound, not speed
SMOKE_FIGURES = ("migration_trip_to_first_step_seconds", "warm_spare_trip_to_first_step_seconds",
                 "migration_fault_to_first_step_seconds", "migration_lost_steps", "migration_ok_fraction",
                 "crash_fault_to_first_step_seconds", "crash_lost_steps", "crash_ok_fraction",
                 "plain_failover_over_warm_ratio")
# (figure, numerator, denominator, label): each ratio divides two figures of one run, same measure
RATIOS = (
    ("two_victims_over_one_ratio", "two_victims_trip_to_first_step_seconds", "migration_trip_to_first_step_seconds",
     "two victims of 3 / one victim of 2 nodes (trip -> first step)"),
    ("cold_torchrun_over_warm_ratio", "cold_spare_torchrun_trip_to_first_step_seconds",
     "migration_trip_to_first_step_seconds", "torchrun cold spare / warm spare (trip -> first step)"),
    ("plain_failover_over_warm_ratio", "crash_fault_to_first_step_seconds", "migration_fault_to_first_step_seconds",
     "plain torchrun crash failover / warm spare (fault -> first step)"),
    ("etcd_over_c10d_ratio", "etcd_migration_trip_to_first_step_seconds", "migration_trip_to_first_step_seconds",
     "etcd-v2 / c10d warm spare (trip -> first step)"),
    ("two_victims_over_one_same_job_ratio", "two_victims_trip_to_first_step_seconds",
     "one_of_three_trip_to_first_step_seconds", "two victims / one victim, same 3-node job (trip -> first step)"),
    ("lightning_over_reference_ratio", "lightning_migration_fault_to_first_step_seconds",
     "migration_fault_to_first_step_seconds", "Lightning job / our own loop, warm spare (fault -> first step)"),
    ("torchtitan_over_reference_ratio", "torchtitan_migration_fault_to_first_step_seconds",
     "migration_fault_to_first_step_seconds", "TorchTitan job / our own loop, warm spare (fault -> first step)"),
    ("hosts_over_loopback_xid79_ratio", "hosts_xid79_fault_to_first_step_seconds",
     "loopback_xid79_fault_to_first_step_seconds", "Xid 79: namespaced hosts / loopback (fault -> first step)"),
    ("hosts_over_loopback_power_off_ratio", "hosts_power_off_fault_to_first_step_seconds",
     "loopback_kill_fault_to_first_step_seconds", "power-off on hosts / kill -9 on loopback (fault -> first step)"),
    ("hosts_over_loopback_power_off_window_0_3_ratio", "hosts_power_off_window_0_3_fault_to_first_step_seconds",
     "loopback_kill_fault_to_first_step_seconds",
     "power-off on hosts, 0.3 s silence window / kill -9 on loopback (fault -> first step)"),
)


SUDDEN = ("kill", "kill-two", "kill-snap", "loopback-kill", "hosts-power-off", "hosts-power-off-0.3")
KILL_SNAP_STEP = 29  # with --interval-steps 10 the disk snapshots are of steps 9, 19, 29, ...


def snapshot_in_flight(r: dict) -> bool:
    """The kill landed before the disk snapshot of the step it was aimed at (``KILL_SNAP_STEP``)
    committed: that snapshot's commit is logged after the fault, or never (its writer died)."""
    t_fault = next((e["time"] for e in r.get("timeline", []) if e["stage"] == "fault injected"), None)
    return t_fault is not None and not any(x.get("step") == KILL_SNAP_STEP and x.get("time") and x["time"] <= t_fault
                                           for x in r.get("snapshots", []))


def bridge_bytes(r: dict) -> float | None:
    """Bytes that crossed the bridge into the hosts that ended in the job without being in it at
    the fault (the spares): the state restored into them plus their training traffic to the end."""
    moved = r.get("bridge_bytes_since_fault")
    if not moved:
        return None
    spares = [n for n in r.get("final_nodes", []) if n.startswith("spare")]
    return float(sum(moved.get(n, {}).get("to_host", 0) for n in spares))


def by_path(runs: list[dict]) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for r in runs:
        rows.setdefault(r["path"], []).append(r["drill"])
    return rows


def summarise(runs: list[dict]) -> dict[str, float | None]:
    """The figures of the drills finished so far (medians over the drills that succeeded)."""
    figures: dict[str, float | None] = {}
    for n, drills in by_path(runs).items():
        ok = [r for r in drills if r.get("ok")]
        if n == "warm":  # each stage's own duration, as the goodput simulator reads them
            own: dict[str, list[float]] = {}
            for r in ok:
                for e in r["timeline"]:
                    own.setdefault(e["stage"], []).append(e["duration"])
            for stage, vals in own.items():
                figures[f"migration_stage_{slug(stage)}_seconds"] = median(vals)
        trip = [r["trip_to_first_step_seconds"] for r in ok if r.get("trip_to_first_step_seconds") is not None]
        fault = [r["fault_to_first_step_seconds"] for r in ok if r.get("fault_to_first_step_seconds") is not None]
        lost = [len(r["recomputed_steps"]) for r in ok]
        p = FIGURE_PREFIX[n]
        if n != "crash":
            figures[f"{p}trip_to_first_step_seconds"] = median(trip)
        if n == "warm":  # the goodput simulator's migrate_warm_seconds (its migrate_seconds: the cold spare)
            figures["warm_spare_trip_to_first_step_seconds"] = median(trip)
        figures[f"{p}fault_to_first_step_seconds"] = median(fault)
        figures[f"{p}lost_steps"] = median(lost)
        figures[f"{p}max_lost_steps"] = max(lost) if lost else None
        figures[f"{p}ok_fraction"] = len(ok) / len(drills) if drills else None
        figures[f"{p}drills_count"] = len(drills)
        verified = [r for r in ok if "verify" in r]
        if verified:
            figures[f"{p}bitwise_equal_fraction"] = sum(bool(r["verify"]["bitwise_equal"]) for r in verified) / len(verified)
        moved = [b for b in map(bridge_bytes, ok) if b is not None]
        if moved:
            figures[f"{p}bytes_into_spare_hosts"] = median(moved)
        if n in SUDDEN:  # the detection split out: fault -> dead node declared, fault -> spare's workers started
            for what in ("declared", "spare_workers"):
                vals = [r[f"fault_to_{what}_seconds"] for r in ok if r.get(f"fault_to_{what}_seconds") is not None]
                figures[f"{p}fault_to_{what}_seconds"] = median(vals)
        if n == "kill-snap" and drills:
            figures[f"{p}in_flight_fraction"] = sum(map(snapshot_in_flight, drills)) / len(drills)
    for name, num, den, _ in RATIOS:
        if figures.get(num) and figures.get(den):
            figures[name] = figures[num] / figures[den]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, help="drills per path (default 5; 1 with --smoke)")
    ap.add_argument("--interval-steps", type=int, default=10)
    ap.add_argument("--etcd", action="store_true", help="also the etcd-v2 rendezvous (needs etcd on PATH)")
    ap.add_argument("--only", help="comma-separated paths to run (default: all but warm-etcd, lightning and torchtitan)")
    ap.add_argument("--trainer", choices=["lightning", "torchtitan"],
                    help="compare that trainer's job with our own loop: the paths warm and that trainer's, side by side")
    ap.add_argument("--hosts", choices=["loopback", "netns"], default="loopback",
                    help="netns: the host faults on namespaced hosts (root), each beside its loopback counterpart "
                         f"in the same run ({', '.join(HOST_PATHS)})")
    _report.add_json_argument(ap)
    args, extra = ap.parse_known_args()
    if args.smoke:
        args.runs = args.runs or 1
        args.only = args.only or ("loopback-xid79,hosts-xid79" if args.hosts == "netns" else "warm,crash")
        extra = SMOKE_ARGS + extra
    args.runs = 5 if args.runs is None else args.runs
    if args.trainer and not args.only:
        args.only = f"warm,{args.trainer}"
    default = HOST_PATHS if args.hosts == "netns" else [n for n in PATHS if n not in HOST_PATHS
                                                        and (n not in BY_NAME or n == "warm-etcd")]
    names = args.only.split(",") if args.only else [n for n in default if n != "warm-etcd" or args.etcd]
    unknown = set(names) - set(PATHS)
    if unknown:
        ap.error(f"unknown path(s) {sorted(unknown)}; choose from {sorted(PATHS)}")
    # its own report when only sudden losses run (docs/measured.json keeps one report per bench and condition)
    bench = ("migration_hosts" if args.hosts == "netns" else
             "migration_sudden" if set(names) <= {"kill", "kill-two", "kill-snap"} else "migration")
    results = _report.Results(args.json, bench, summarise)
    for _ in range(args.runs):  # interleaved, so every path sees the same machine noise
        for n in names:
            results.add({"path": n, "drill": drill(args.interval_steps, PATHS[n][1] + extra)})
    rows = by_path(results.runs)
    load = os.getloadavg()
    print(f"host: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) at the end")
    for n in names:
        ok = [r for r in rows[n] if r.get("ok")]
        since = "fault" if n in SUDDEN else "trip"
        print(f"\n{PATHS[n][0]}: {len(ok)}/{len(rows[n])} drills ok; seconds after the {since} (median / max)")
        for r in rows[n]:
            if not r.get("ok") and r.get("error"):
                print(f"  failed: {r['error'][-200:]}")
        for stage, vals in stage_durations(ok).items():
            print(f"  {stage:<26} {median(vals):>7.2f} {max(vals):>7.2f}")
        if ok and ok[0]["timeline"] and any(e.get("phases") for e in ok[0]["timeline"]):
            phases: dict[str, list[float]] = {}
            for r in ok:
                for e in r["timeline"]:
                    for k, v in (e.get("phases") or {}).items():
                        phases.setdefault(k, []).append(v)
            print("  spare worker setup: " + ", ".join(f"{k} {median(v):.2f}" for k, v in phases.items()))

    def fmt(vals: list[float]) -> str:
        return f"{statistics.median(vals):.2f} / {max(vals):.2f}" if vals else "-"

    print(f"\n{'path':<38} {'ok':>5} {'fault->first step s':>20} {'trip->first step s':>19} {'recomputed':>11}"
          f" {'bitwise':>8} {'MB into spare':>14}")
    for n in names:
        ok = [r for r in rows[n] if r.get("ok")]
        trip = [r["trip_to_first_step_seconds"] for r in ok if r.get("trip_to_first_step_seconds") is not None]
        fault = [r["fault_to_first_step_seconds"] for r in ok if r.get("fault_to_first_step_seconds") is not None]
        lost = [len(r["recomputed_steps"]) for r in ok]
        verified = [r for r in ok if "verify" in r]
        bitwise = f"{sum(r['verify']['bitwise_equal'] for r in verified)}/{len(verified)}" if verified else "-"
        moved = [b / 1e6 for b in map(bridge_bytes, ok) if b is not None]
        print(f"{PATHS[n][0]:<38} {len(ok)}/{len(rows[n]):<3} {fmt(fault):>20} {fmt(trip) if n != 'crash' else '-':>19}"
              f" {fmt(lost):>11} {bitwise:>8} {fmt(moved):>14}")
    sudden = [n for n in names if n in SUDDEN]
    if sudden:
        print(f"\n{'sudden loss: seconds after the fault':<38} {'dead node declared':>19} {'spare workers start':>20}"
              f" {'first step':>11}")
    for n in sudden:
        ok = [r for r in rows[n] if r.get("ok")]
        cols = [[r[k] for r in ok if r.get(k) is not None] for k in
                ("fault_to_declared_seconds", "fault_to_spare_workers_seconds", "fault_to_first_step_seconds")]
        note = (f"  (snapshot in flight at the kill: {sum(map(snapshot_in_flight, rows[n]))}/{len(rows[n])})"
                if n == "kill-snap" else "")
        print(f"{PATHS[n][0]:<38} {fmt(cols[0]):>19} {fmt(cols[1]):>20} {fmt(cols[2]):>11}{note}")
    figures = summarise(results.runs)
    shown = [(label, figures[name]) for name, _, _, label in RATIOS if figures.get(name)]
    if shown:
        print()
    for label, value in shown:
        print(f"{label:<66} {value:>6.2f}x")
    results.finish()


if __name__ == "__main__":
    main()
