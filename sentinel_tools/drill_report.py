"""The drill's report: the timeline of every stage, rebuilt from what each process logged (the
job's progress log, the victim's migration record), the figures (fault -> first step, recomputed
steps, where the state came from), the fault's verdict, the bitwise ``--verify``, and the
printed form of all that."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sentinel_tools import faults
from sentinel_tools.harness import TRAINER_JOBS, repo_root, trainer_job_argv

if TYPE_CHECKING:
    from sentinel_tools.drill_cluster import Drill, Node


@dataclass
class Timeline:
    t0: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, stage: str, at: float | None, **info: Any) -> None:
        if at is not None:
            self.events.append({"stage": stage, "time": at, "t": round(at - self.t0, 3), **info})


@dataclass
class Stages:
    """What the progress log says happened after the fault."""

    admitted: list[dict[str, Any]]
    loaded: list[dict[str, Any]]
    t_loaded: float | None
    t_first: float | None
    finished: dict[str, Any] | None
    lost: list[int]
    final_nodes: list[str]


def _stages(drill: "Drill", tl: Timeline, events: list[dict[str, Any]], mig: dict[str, Any], victim: "Node",
            t_fault: float) -> Stages:
    """Adds every stage to ``tl`` (the victim's migration record's times, then the job's own events)."""
    times = mig.get("times", {})
    tl.add("detected", times.get("tripped"), rule=mig.get("rule"), reason=mig.get("reason"))
    tl.add("snapshot requested", times.get("requested"))
    tl.add("snapshot committed", times.get("acknowledged"), step=mig.get("snapshot_step"), ok=mig.get("snapshot_ok"))
    tl.add("node cordoned", times.get("cordoned"))
    tl.add("agent stopped", times.get("drained"))
    spare = mig.get("spare") or {}
    tl.add("spare chosen", times.get("spare_chosen"), node=spare.get("node"), distance=spare.get("distance"),
           why=spare.get("why"))
    spares = {n.name for n in drill.nodes if n.spare}
    admitted = [e for e in events if e["event"] == "admitted" and e["node"] in spares and e["time"] >= t_fault]
    loaded = [e for e in events if e["event"] == "resumed" and e["node"] in spares and e["time"] >= t_fault]
    if not loaded:  # no spare joined: the job went on with the nodes it had (or did not resume at all)
        loaded = [e for e in events if e["event"] == "resumed" and e["time"] >= t_fault]
    # the survivors' ranks: the victims' own ranks leave their hold too, at their drain
    victims = drill.victim_names or {victim.name}
    left = [e for e in events if e["event"] == "drained" and e["time"] >= t_fault and e["node"] not in victims]
    tl.add("survivors left the hold", min((e["time"] for e in left), default=None))
    # each worker's own time.time() at its start (trainer.train stamps it before importing torch):
    # the same clock as every other event, never /proc's start time (whole-second boot time)
    # the slot rendezvous's declaration of a node that died without leaving (its agent records it):
    # the detection of a sudden loss, split out of the time to the spare's workers
    vacant = min((e for e in events if e["event"] == "vacant" and e["time"] >= t_fault), key=lambda e: e["time"],
                 default={})
    tl.add("dead node declared", vacant.get("time"), how=vacant.get("how"), evidence=vacant.get("evidence") or None)
    started = [e.get("process_started") for e in admitted if e.get("process_started")]
    tl.add("spare workers started", min(started, default=None), warm=drill.args.agent == "warm")
    t_admit = min((e["time"] for e in admitted), default=None)
    tl.add("spare admitted", t_admit, node=admitted[0]["node"] if admitted else None,
           worker_store=sorted({e.get("worker_store") or "?" for e in admitted}) or None,
           distance=spare.get("distance") if admitted and spare.get("node") == admitted[0]["node"] else None)
    t_loaded = min((e["time"] for e in loaded), default=None)
    restore = (loaded[0].get("restore") or {}) if loaded else {}
    tl.add("snapshot loaded", t_loaded, start_step=loaded[0]["start"] if loaded else None,
           source=loaded[0]["source"] if loaded else None, tier=restore.get("tier"),
           phases=loaded[0].get("phases") if loaded else None)
    steps = [e for e in events if e["event"] == "step"]
    after = [e for e in steps if t_loaded is not None and e["time"] >= t_loaded]
    t_first = after[0]["time"] if after else None
    tl.add("first step on the spare", t_first, step=after[0]["step"] if after else None)
    finished = next((e for e in events if e["event"] == "finished"), None)
    tl.add("job finished", finished["time"] if finished else None)
    seen: dict[int, int] = {}
    for e in steps:
        seen[e["step"]] = seen.get(e["step"], 0) + 1
    lost = sorted(s for s, n in seen.items() if n > 1)
    final_nodes = sorted({e["node"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault})
    tl.events.sort(key=lambda e: e["time"])
    prev = tl.t0
    for e in tl.events:
        e["duration"] = round(e["time"] - prev, 3)
        prev = e["time"]
    return Stages(admitted, loaded, t_loaded, t_first, finished, lost, final_nodes)


def _since(tl: Timeline, stage: str, t_fault: float) -> float | None:
    at = next((e["time"] for e in tl.events if e["stage"] == stage), None)
    return round(at - t_fault, 3) if at is not None else None


def report(drill: "Drill", tl: Timeline, victim: "Node", t_fault: float) -> dict[str, Any]:
    events = drill.events()
    mig = drill._migration(victim)
    times = mig.get("times", {})
    s = _stages(drill, tl, events, mig, victim, t_fault)
    t_first = s.t_first
    result = {
        "fault": drill.args.fault,
        "failed_node": victim.name,
        "timeline": tl.events,
        "finished": s.finished is not None,
        "spare_in_place": bool(s.admitted) and victim.name not in s.final_nodes,
        "replacement": s.admitted[0]["node"] if s.admitted else None,  # the spare that took the failed node's ranks
        "final_nodes": s.final_nodes,
        "recomputed_steps": s.lost,
        # worker groups formed after the fault (rank 0 admitted once per re-rendezvous)
        "membership_changes": sum(1 for e in events if e["event"] == "admitted" and e["rank"] == 0
                                  and e["time"] >= t_fault),
        "trip_to_first_step_seconds": round(t_first - times["tripped"], 3) if t_first and "tripped" in times else None,
        "fault_to_first_step_seconds": round(t_first - t_fault, 3) if t_first else None,
        # a sudden loss split in two: until the dead node was declared, until the spare's workers started
        "fault_to_declared_seconds": _since(tl, "dead node declared", t_fault),
        "fault_to_spare_workers_seconds": _since(tl, "spare workers started", t_fault),
        "migration_notes": mig.get("notes", []),
        "spare_choice": mig.get("spare"),
        # the memory tier's replica placement as rank 0 printed it: at the start, and after the fault
        "replica_placement": [{"time": e["time"], "placement": e.get("placement")} for e in events
                              if e["event"] == "replica_placement"],
        # every snapshot the job finished (ok or failed), as rank 0 logged it
        "snapshots": [{k: e.get(k) for k in ("step", "ok", "kind", "time", "node")}
                      for e in events if e["event"] == "snapshot"],
        "final": s.finished,
        "workdir": str(drill.work),
        "restore": restore_report(drill, events, t_fault),
    }
    result.update(drill.host_report())
    result["rendezvous_stalls"] = rendezvous_stalls(drill)  # rounds that made no progress for a while, if any
    if result["restore"].get("fallback"):
        result.setdefault("notes", []).append(result["restore"]["fallback"])
    if drill.args.verify and s.finished:
        result["verify"] = verify(drill, s.finished)
    result["ok"] = _verdict(drill, result, events, mig, victim, t_fault, s)
    return result


def _verdict(drill: "Drill", result: dict[str, Any], events: list[dict[str, Any]], mig: dict[str, Any],
             victim: "Node", t_fault: float, s: Stages) -> bool:
    a = drill.args
    fault = faults.get(a.fault)
    ok = result["finished"] and result["spare_in_place"]
    if a.victims > a.spares and fault.replaces_node:
        result["notes"] = [f"{a.victims} failed node(s) but {a.spares} spare(s): the job went on with "
                           f"{len(s.final_nodes)} node(s), resharded from the migrate snapshot"]
        result["world_after"] = max((e["world"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault),
                                    default=None)
        if "verify" in result:
            result["verify"]["note"] = "different world size: not expected to be bitwise equal"
        return result["finished"] and victim.name not in s.final_nodes and not s.lost and bool(s.final_nodes)
    memory = a.memory_interval_steps > 0
    # sudden losses: at most one step with the memory tier (unless every copy of a shard was
    # lost: then the disk snapshot, up to its interval); without it, up to the disk interval
    bound = max(1, a.interval_steps) if not memory or result["restore"]["tier"] == "disk" else 1
    newest = None
    if result["restore"]["tier"] == "disk":  # an async save still in flight at the fault is lost with it
        last, newest = _last_step_and_disk_snapshot(drill, events, t_fault)
        result["restore"]["newest_complete_at_fault"] = newest
        bound = max(bound, last - newest)
    if a.fail_snapshot and fault.replaces_node:
        # The migrate snapshot failed: the job resumes from the newest snapshot that did
        # commit and recomputes the steps from there to the step it held at. How many that
        # is depends on how long detection took, so no fixed bound is asserted.
        good = [x["step"] for x in result["snapshots"] if x["ok"] and s.t_loaded is not None and x["time"] < s.t_loaded]
        start = s.loaded[0]["start"] if s.loaded else None
        held = mig.get("snapshot_step")
        ok = ok and held is not None and start == max(good, default=-1) + 1 and s.lost == list(range(start, held + 1))
    else:
        outcome = faults.Outcome(events, mig, victim, t_fault, s.t_first, s.lost, bound, s.final_nodes, ok)
        ok = fault.verdict(drill, result, outcome)
        if newest is not None:  # and from that snapshot, not an older one
            ok = ok and (result["restore"].get("step") or 0) >= newest
    if "verify" in result:
        ok = ok and result["verify"]["bitwise_equal"]
    return ok


def _last_step_and_disk_snapshot(drill: "Drill", events: list[dict[str, Any]], t_fault: float) -> tuple[int, int]:
    """The old world's last step, and the newest disk snapshot complete before the fault (what a
    resume from disk must load; the steps between are recomputed): from the job's snapshot lines,
    or, for TorchTitan, its folder (``step-N`` is complete once DCP wrote ``.metadata``, last)."""
    # the old world's last step: it may be logged just after the fault, never after the restart
    restart = min((e["time"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault), default=t_fault)
    done = [e["step"] for e in events if e["event"] == "step" and e["time"] < restart]
    complete = [e["step"] for e in events if e["event"] == "snapshot" and e.get("ok") and e["time"] < t_fault
                and not str(e.get("path") or "").startswith("memory:")]
    if drill.trainer == "torchtitan":
        for meta in (drill.job_dir / "torchtitan" / "checkpoint").glob("step-*/.metadata"):
            step = meta.parent.name[len("step-"):]
            if step.isdigit() and meta.stat().st_mtime < t_fault:
                complete.append(int(step))
    return max(done, default=0), max(complete, default=0)


def restore_report(drill: "Drill", events: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
    """Where the ranks that resumed after the fault took their state from (rank 0's view;
    every rank agrees on the tier and step)."""
    resumed = [e for e in events if e["event"] == "resumed" and e["rank"] == 0 and e["time"] >= t_fault and e.get("restore")]
    if not resumed:
        return {"tier": None, "peer": [], "own": []}
    last = max(resumed, key=lambda e: e["time"])  # the restart that stuck
    r = last["restore"]
    out = {"tier": r.get("tier"), "step": last["start"] - 1, "own": r.get("own", []), "peer": r.get("peer", []),
           "disk": r.get("disk", []), "seconds": r.get("seconds"), "memory_rejected": r.get("memory_rejected", {})}
    if drill.args.memory_interval_steps > 0 and r.get("tier") != "memory":
        out["fallback"] = (f"memory tier could not restore ({r.get('memory_reason') or 'unknown'}): fell back to "
                           f"the newest disk snapshot ({last['source'] or 'none'})")
    return out


def cached_reference(cache: Path, world: int, steps: int, run, job: str = "reference") -> tuple[dict[str, Any] | None, str]:
    """``--reference-cache``: the uninterrupted run's final state for this world size, step count
    and trainer code (a digest of ``trainer/``'s sources), made by ``run(directory)`` once and
    reused by every later drill that verifies the same job; drills running at once wait for the
    first (a file lock). A failed run is not kept."""
    import fcntl
    import hashlib

    code = hashlib.sha256()
    for src in sorted([*(repo_root() / "trainer").rglob("*.py"), *(repo_root() / "examples").glob("*.py")]):
        code.update(src.relative_to(repo_root()).as_posix().encode() + b"\0" + src.read_bytes())
    key = f"{job}-world{world}-steps{steps}-{code.hexdigest()[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / f"{key}.json"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if kept.exists():
            return json.loads(kept.read_text()), ""
        work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache))
        try:
            want, error = run(work)
            if want is not None:
                tmp = cache / f"{key}.json.tmp"
                tmp.write_text(json.dumps(want))
                os.replace(tmp, kept)
            return want, error
        finally:
            shutil.rmtree(work, ignore_errors=True)


def verify(drill: "Drill", finished: dict[str, Any]) -> dict[str, Any]:
    cache = drill.args.reference_cache
    if cache is None:
        want, error = reference_run(drill, drill.work / "reference")
    else:
        want, error = cached_reference(Path(cache), drill.args.nodes * drill.args.procs_per_node, drill.args.steps,
                                       lambda ref: reference_run(drill, ref), job=getattr(drill.args, "trainer", "reference"))
    if want is None:
        return {"bitwise_equal": False, "error": error}
    return {"bitwise_equal": want["params"] == finished["params"] and want["optim"] == finished["optim"],
            "reference_params_sha256": want["params"], "drill_params_sha256": finished["params"]}


def reference_run(drill: "Drill", ref: Path) -> tuple[dict[str, Any] | None, str]:
    """The same job uninterrupted, under plain torchrun (independent of the agent under test):
    its final state, or None and why."""
    a = drill.args
    ref.mkdir(parents=True, exist_ok=True)
    world = a.nodes * a.procs_per_node
    env = drill.env
    if drill.trainer in TRAINER_JOBS:  # the example job on one node of `world` processes, its digest where it writes it
        job = trainer_job_argv(drill.trainer, a, ref, world, 1)
        env = {**env, "SENTINEL_FINAL_FILE": str(ref / "final.json")}
    else:
        job = ["-m", "trainer.train", "--steps", str(a.steps), "--snapshot-dir", str(ref / "snapshots"),
               "--final", str(ref / "final.json")]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *job]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=str(repo_root()))
    if r.returncode != 0:
        return None, r.stderr[-2000:]
    return json.loads((ref / "final.json").read_text()), ""


def print_timeline(result: dict[str, Any]) -> None:
    print(f"drill: fault {result['fault']} on {result['failed_node']}   workdir {result['workdir']}")
    print(f"{'stage':<26} {'t (s)':>8} {'+ (s)':>8}  detail")
    for e in result["timeline"]:
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("stage", "time", "t", "duration") and v is not None)
        print(f"{e['stage']:<26} {e['t']:>8.2f} {e['duration']:>8.2f}  {detail}")
    print(f"trip -> first step on the spare: {result['trip_to_first_step_seconds']} s;"
          f" fault -> first step: {result['fault_to_first_step_seconds']} s")
    if result.get("fault_to_spare_workers_seconds") is not None and not result.get("trip_to_first_step_seconds"):
        declared = result.get("fault_to_declared_seconds")
        print(f"fault -> spare workers started: {result['fault_to_spare_workers_seconds']} s"
              + (f" (dead node declared after {declared} s)" if declared is not None else ""))
    print(f"recomputed steps (work lost): {len(result['recomputed_steps'])} {result['recomputed_steps'] or ''}")
    rs = result.get("restore") or {}
    if rs.get("tier"):
        disk = f", from the disk snapshot of that step (every memory copy lost): {rs['disk']}" if rs.get("disk") else ""
        print(f"restored from: {rs['tier']}" + (f" at step {rs['step']} (shards from this node's memory: {rs['own']}, "
                                                f"from a peer's replica: {rs['peer']}{disk})" if rs["tier"] == "memory" else ""))
    if result.get("store_lost"):
        lost = result["store_lost"]
        if result["finished"]:
            print("store lost: the job finished without it (it needed no new membership after the fault)")
        else:
            print(f"store lost: {lost['line'] or 'no agent said why'} (the job was gone {lost['seconds_after_fault']} s "
                  f"after the fault; in the status of the daemons of {', '.join(lost.get('daemons_saying_so') or []) or '-'})")
    for note in result["migration_notes"] + result.get("notes", []):
        print(f"note: {note}")
    if "verify" in result:
        print(f"verify: final parameters bitwise equal to an uninterrupted run: {result['verify']['bitwise_equal']}")
    why_not = (result.get("job_health") or {}).get("not_handed_over")
    if why_not:
        print(f"not handed over: {why_not}")
    print("drill: OK" if result["ok"] else "drill: FAILED")


STALL_MARK = "rendezvous stalled: "


def rendezvous_stalls(drill: "Drill") -> list[str]:
    """Each agent's last ``rendezvous stalled:`` line (trainer/rdzv_watch.py: who the round it is
    stuck in waits for), for a drill whose job did not finish."""
    lines = []
    for node in drill.nodes:
        try:
            text = (node.root / "agent.log").read_text(errors="replace")
        except OSError:
            continue
        last = next((x for x in reversed(text.splitlines()) if STALL_MARK in x), None)
        if last is not None:
            lines.append(f"{node.name}'s agent: {STALL_MARK}{last.split(STALL_MARK, 1)[1]}")
    return lines
