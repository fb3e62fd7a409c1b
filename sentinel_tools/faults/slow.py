"""A straggler: the node's ranks compute --slow-factor times slower and its GPU 0 reports a
hardware slowdown. Judged by :func:`sentinel_tools.drill_verdict.job_health`: the job names the
node within 20 steps with its cause, and the spare in its place is no straggler."""

from __future__ import annotations

from sentinel.sources import simulated
from sentinel_tools.drill_verdict import job_health
from sentinel_tools.faults.base import Fault

DETECT_BOUND_STEPS = 20


def inject(drill, victim) -> None:
    (victim.runtime / "drill-fault").write_text(f"slow={drill.args.slow_factor}")
    simulated.inject(victim.gpus, 0, ["set=throttle_reasons:8"])  # NVML clocks event: HW slowdown


def verdict(drill, result, outcome) -> bool:
    """Handed over: as job_health judges it. Not handed over: right only when the job named the node
    within DETECT_BOUND_STEPS with its hardware cause and the daemon decided it would not pay (the
    drill's defaults, 60 steps at 0.1 s, leave a few seconds to win against a 5 s hand-over)."""
    mig = outcome.migration
    health = result["job_health"] = job_health("slow", outcome.events, mig.get("times", {}), mig, outcome.t_fault,
                                               outcome.t_first, failed=outcome.victim.name,
                                               replacement=result["replacement"])
    if outcome.base_ok:
        return len(outcome.lost) <= 1 and health["ok"]
    seen = drill.straggler_seen(outcome.victim) or {}
    would_not_pay = seen.get("action") == "alert" and "less than the hand-over" in str(seen.get("why", ""))
    health["not_handed_over"] = f"it would not pay: {seen.get('why')}" if would_not_pay else None
    detected = health["steps_to_detect"] is not None and health["steps_to_detect"] <= DETECT_BOUND_STEPS
    cause = any("hw_slowdown" in str(c) for c in seen.get("causes") or [])
    return result["finished"] and not outcome.lost and would_not_pay and detected and cause


FAULT = Fault("slow", "a straggler: the node's ranks compute --slow-factor times slower, its GPU 0 reports a hardware "
              "slowdown", inject, verdict=verdict)
