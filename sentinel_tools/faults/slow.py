"""A straggler: the node's ranks compute --slow-factor times slower and its GPU 0 reports a
hardware slowdown. The straggler rule must name the cause within 20 steps, and the job must
step at its old pace (within 10 %) once the spare is in."""

from __future__ import annotations

from sentinel.sources import simulated
from sentinel_tools.faults.base import Fault, median, step_health

DETECT_BOUND_STEPS = 20
PACE_BOUND = 1.10


def inject(drill, victim) -> None:
    (victim.runtime / "drill-fault").write_text(f"slow={drill.args.slow_factor}")
    simulated.inject(victim.gpus, 0, ["set=throttle_reasons:8"])  # NVML clocks event: HW slowdown


def verdict(drill, result, outcome) -> bool:
    mig, t_fault = outcome.migration, outcome.t_fault
    tripped = mig.get("times", {}).get("tripped")
    steps, out = step_health(outcome.events, mig, t_fault, outcome.t_first)
    # a trip before the fault is a false straggler, not a detection; the cause must be named
    out["steps_to_detect"] = sum(1 for t, _ in steps if t_fault <= t <= tripped) if tripped and tripped > t_fault else None
    out["step_seconds_slowed"] = median([b - a for (a, _), (b, _) in zip(steps, steps[1:])
                                         if tripped and t_fault <= a and b <= tripped])
    out["cause_named"] = "hw_slowdown" in str(mig.get("reason", ""))
    b, a = out["step_seconds_before"], out["step_seconds_after"]
    out["after_over_before"] = round(a / b, 3) if a and b else None
    out["ok"] = (mig.get("rule") == "straggler" and out["steps_to_detect"] is not None
                 and out["steps_to_detect"] <= DETECT_BOUND_STEPS and out["cause_named"]
                 and out["after_over_before"] is not None and out["after_over_before"] <= PACE_BOUND)
    result["job_health"] = out
    return outcome.base_ok and len(outcome.lost) <= 1 and out["ok"]


FAULT = Fault("slow", "a straggler: the node's ranks compute --slow-factor times slower, its GPU 0 reports a hardware "
              "slowdown", inject, verdict=verdict)
