"""One host's link shaped to --link-rate (tc tbf, both directions; this kernel has no netem):
its ranks compute as fast as ever, but everything they send or receive is slow. The straggler
logic must name the host within 20 steps; the hand-over happens only when it pays, else the
daemon alerts and the job finishes on its nodes ("not handed over: it would not pay")."""

from __future__ import annotations

from sentinel_tools.faults.base import Fault
from sentinel_tools.faults.slow import DETECT_BOUND_STEPS

DEFAULT_RATE = "20mbit"


def inject(drill, victim) -> None:
    drill.shape(victim, getattr(drill.args, "link_rate", DEFAULT_RATE))


def verdict(drill, result, outcome) -> bool:
    mig, t_fault = outcome.migration, outcome.t_fault
    tripped = mig.get("times", {}).get("tripped")
    steps = sorted(e["time"] for e in outcome.events if e["event"] == "step")
    seen = drill.straggler_seen(outcome.victim) or {}
    named = mig.get("rule") == "straggler" or seen.get("action") == "alert"
    tripped = tripped or seen.get("time")
    to_detect = sum(1 for t in steps if t_fault <= t <= tripped) if named and tripped and tripped > t_fault else None
    out = {"rule": mig.get("rule"), "reason": mig.get("reason"), "steps_to_detect": to_detect,
           "handed_over": outcome.base_ok}
    out["straggler_seen"] = drill.straggler_seen(outcome.victim)  # the victim daemon's newest straggler score
    result["slow_link"] = out
    if not named or to_detect is None or to_detect > DETECT_BOUND_STEPS:
        return False
    if outcome.base_ok:
        return len(outcome.lost) <= 1
    # named, not handed over: only right when the daemon decided it would not pay
    seen = out["straggler_seen"] or {}
    return result["finished"] and seen.get("action") == "alert"


FAULT = Fault("slow-link", "one host's link shaped to --link-rate with tc tbf (--hosts netns): slow network, normal "
              "compute", inject, verdict=verdict, needs_hosts=True, min_nodes=3,
              min_nodes_why="two nodes share their one link: it takes a third to tell which end is slow")
