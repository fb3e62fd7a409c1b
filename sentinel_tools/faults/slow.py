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
    mig = outcome.migration
    result["job_health"] = job_health("slow", outcome.events, mig.get("times", {}), mig, outcome.t_fault,
                                      outcome.t_first, failed=outcome.victim.name, replacement=result["replacement"])
    return outcome.base_ok and len(outcome.lost) <= 1 and result["job_health"]["ok"]


FAULT = Fault("slow", "a straggler: the node's ranks compute --slow-factor times slower, its GPU 0 reports a hardware "
              "slowdown", inject, verdict=verdict)
