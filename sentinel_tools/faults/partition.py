"""One host's link goes down while all its processes live on (--hosts netns). The scheduler
(the drill) sees the node unreachable and gives the job a spare; the job goes on without the
cut-off host, from the memory tier; once the spare steps, the link comes back and the cut-off
ranks must leave without stepping again in the new generation.

Fencing by generation (:mod:`trainer.fence`) needs the slot rendezvous (``--rdzv-backend
sentinel``, this fault's default): its generation is the token the cut-off node's rendezvous
writes and its rank 0's snapshot commits are checked against. torch's c10d rendezvous has no such
token (a healed node re-joins its wait list and every survivor restarts), so it is refused."""

from __future__ import annotations

import json
import time

from sentinel_tools.faults.kill import replace
from sentinel_tools.faults.base import Fault

HEAL_POLL_SECONDS = 0.1
LEAVE_BOUND_SECONDS = 30.0  # the cut-off agent leaves by itself within this after the heal (not at teardown)
LEFT_LINE = "trainer.elastic: left the job:"
# a cut-off agent that asked the store while the partition lasted longer than the store's own
# failover (etcd: failover_timeout, 20 s) stops on its one line instead: it left, nothing stepped
UNREACHABLE_LINE = "trainer.elastic: the rendezvous store "


def inject(drill, victim) -> None:
    drill.partition(victim)


def replace_then_heal(drill, victims, deadline: float) -> None:
    """The scheduler's replacement, then the link back once the job steps on the spare."""
    t_fault = time.time()
    replace(drill, victims, deadline)
    gone = {v.name for v in victims}
    while time.time() < deadline:
        events = drill.events()
        resumed = [e["time"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault and e["node"] not in gone]
        if resumed and any(e["event"] == "step" and e["time"] > min(resumed) for e in events):
            break
        if drill._job_dead():
            break
        time.sleep(HEAL_POLL_SECONDS)
    for v in victims:
        drill.heal(v)
    drill.healed_at = time.time()


def cut_off_agent_left(drill, victim) -> dict:
    """Whether the cut-off host's agent left by itself after the heal (its slot was given away:
    the generation fence refused its arrival), bounded by LEAVE_BOUND_SECONDS; its one line."""
    healed = getattr(drill, "healed_at", None) or time.time()
    agent = victim.agent
    while agent is not None and agent.poll() is None and time.time() < healed + LEAVE_BOUND_SECONDS:
        time.sleep(HEAL_POLL_SECONDS)
    try:
        log = (victim.root / "agent.log").read_text(errors="replace")
    except OSError:
        log = ""
    lines = [line for line in log.splitlines() if line.startswith((LEFT_LINE, UNREACHABLE_LINE))]
    return {"exited": agent is not None and agent.poll() is not None,
            "exit_status": agent.poll() if agent is not None else None, "line": lines[-1] if lines else ""}


def fence_state(drill) -> dict:
    """The snapshot directory's generation fence and the generations its commits record."""
    try:
        fence = json.loads((drill.snapshots / "GENERATION").read_text())
    except (OSError, ValueError):
        fence = None
    committed = {}
    for marker in sorted(drill.snapshots.glob("step-*/COMMITTED")):
        try:
            committed[marker.parent.name] = json.loads(marker.read_text()).get("generation")
        except (OSError, ValueError):
            continue
    return {"fence": fence, "commit_generations": committed}


def verdict(drill, result, outcome) -> bool:
    """At most one recomputed step; after the heal no rank of the cut-off host stepped again, no
    two processes stepped as one rank after the fault, the cut-off agent left by itself (its
    generation refused), and the snapshot directory's fence moved past the cut-off generation."""
    ok = outcome.base_ok and len(outcome.lost) <= outcome.bound
    victim = outcome.victim.name
    healed = getattr(drill, "healed_at", None)
    steps = [e for e in outcome.events if e["event"] == "step" and e["time"] >= outcome.t_fault]
    # the step in flight when the link went down may still be logged by the cut-off host (its
    # collective finished first); any later step would be the job split in two
    before = [e["step"] for e in outcome.events if e["event"] == "step" and e["time"] < outcome.t_fault]
    in_flight = (max(before) + 1) if before else 0
    # ... and so may any step the new world resumed after: the old world, the cut-off host in it,
    # finished it together (the link went down later than the fault's timestamp: its injection
    # took more than a step under load, ci19b); a split is a cut-off step after the resume point
    resumed = (result.get("restore") or {}).get("step")
    last_old = max(in_flight, resumed) if isinstance(resumed, int) else in_flight
    cut_off_steps = [e["step"] for e in steps if e["node"] == victim and e["step"] > last_old]
    by_rank_step: dict[tuple[int, int], set[int]] = {}
    for e in steps:
        by_rank_step.setdefault((e["rank"], e["step"]), set()).add(e["pid"])
    twins = sorted(k for k, pids in by_rank_step.items() if len(pids) > 1 and k[1] not in outcome.lost)
    left = cut_off_agent_left(drill, outcome.victim)
    fenced = fence_state(drill)
    result["partition"] = {"healed_seconds_after_fault": round(healed - outcome.t_fault, 3) if healed else None,
                           "cut_off_host_steps_after_fault": cut_off_steps, "same_rank_twice": twins,
                           "cut_off_agent": left, **fenced}
    fence_moved = bool(fenced["fence"]) and fenced["fence"].get("generation", 0) > 1
    left_cleanly = (left["exit_status"] == 0 and "another node" in left["line"]
                    or left["exit_status"] == 1 and left["line"].startswith(UNREACHABLE_LINE))
    return (ok and healed is not None and not cut_off_steps and not twins and left["exited"]
            and left_cleanly and fence_moved)


FAULT = Fault("partition", "one host's link goes down while its processes live on (--hosts netns); healed once the "
              "job steps on the spare", inject, verdict=verdict, follow_up=replace_then_heal, sudden=True,
              needs_hosts=True, rdzv_backend="sentinel",
              rdzv_why="its generations fence the cut-off host: c10d has no token, and a healed host re-joins")
