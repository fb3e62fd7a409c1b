"""One host's link goes down while all its processes live on (--hosts netns). The scheduler
(the drill) sees the node unreachable and gives the job a spare; the job goes on without the
cut-off host, from the memory tier; once the spare steps, the link comes back and the cut-off
ranks must leave without stepping again in the new generation."""

from __future__ import annotations

import time

from sentinel_tools.faults.kill import replace
from sentinel_tools.faults.base import Fault

HEAL_POLL_SECONDS = 0.1


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


def verdict(drill, result, outcome) -> bool:
    """At most one recomputed step; after the heal no rank of the cut-off host stepped again, and no
    two processes stepped as one rank after the fault in the same world."""
    ok = outcome.base_ok and len(outcome.lost) <= outcome.bound
    victim = outcome.victim.name
    healed = getattr(drill, "healed_at", None)
    steps = [e for e in outcome.events if e["event"] == "step" and e["time"] >= outcome.t_fault]
    cut_off_steps = [e["step"] for e in steps if e["node"] == victim]
    by_rank_step: dict[tuple[int, int], set[int]] = {}
    for e in steps:
        by_rank_step.setdefault((e["rank"], e["step"]), set()).add(e["pid"])
    twins = sorted(k for k, pids in by_rank_step.items() if len(pids) > 1 and k[1] not in outcome.lost)
    result["partition"] = {"healed_seconds_after_fault": round(healed - outcome.t_fault, 3) if healed else None,
                           "cut_off_host_steps_after_fault": cut_off_steps, "same_rank_twice": twins}
    return ok and healed is not None and not cut_off_steps and not twins


FAULT = Fault("partition", "one host's link goes down while its processes live on (--hosts netns); healed once the "
              "job steps on the spare", inject, verdict=verdict, follow_up=replace_then_heal, sudden=True,
              needs_hosts=True)
