"""What a hang or straggler drill is judged by (``sentinel drill --fault hang / slow``). Pure:
the job's progress events in, a report with its ``ok`` out.

A straggler's hand-over is judged by what the hand-over controls: the compute time of the node
now carrying the straggler's ranks, against the other nodes' in the same windows, as the job's
own progress exchange measured it (the ``exchange`` events rank 0 writes, see
:mod:`trainer.progress`). The wall-clock step before and after is reported beside it, never
judged: on a shared host other processes slow every step down, and the hand-over cannot
undo that (at load ~5 a clean hand-over read 1.1x slower by the wall clock, #47)."""

from __future__ import annotations

from statistics import median
from typing import Any

from sentinel.straggler import StragglerSettings

# The straggler rule's own test: a node is no straggler while its compute over the job's
# median stays below this (trainer.progress scores every window with the same settings).
RELATIVE_THRESHOLD = StragglerSettings().relative_threshold


def _med(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def relative_compute(events: list[dict[str, Any]], node: str | None) -> list[float]:
    """Per exchange window in which ``node`` computed: its compute seconds over the median of
    the other nodes' (in order; empty when the node was in no window with another node)."""
    out = []
    for e in events:
        compute = e.get("compute") or {}
        if e.get("event") != "exchange" or node not in compute:
            continue
        others = [c for n, c in compute.items() if n != node]
        if others and median(others) > 0:
            out.append(compute[node] / median(others))
    return out


def job_health(fault: str, events: list[dict[str, Any]], times: dict[str, float], mig: dict[str, Any],
               t_fault: float, t_first: float | None, *, failed: str, replacement: str | None) -> dict[str, Any]:
    """--fault hang / slow: how soon the job named the culprit, the step time around it, and
    (slow) the failed node's and its replacement's compute over the others' (``exchange``
    events: ``compute`` node -> seconds, ``stragglers`` the nodes that window named)."""
    steps = sorted((e["time"], e["step"]) for e in events if e["event"] == "step")
    tripped = times.get("tripped")
    gaps = list(zip(steps, steps[1:]))
    before = [b - a for (a, _), (b, _) in gaps if b < t_fault]
    after = [b - a for (a, _), (b, _) in gaps if t_first is not None and a >= t_first]
    out: dict[str, Any] = {"rule": mig.get("rule"), "reason": mig.get("reason"),
                           "step_seconds_before": _med(before[-30:]), "step_seconds_after": _med(after[5:])}
    if fault == "hang":
        last = max((t for t, _ in steps if t < (tripped or float("inf"))), default=None)
        out["last_completed_step_to_handover_seconds"] = round(tripped - last, 3) if tripped and last else None
        out["ok"] = (mig.get("rule") == "hang" and out["last_completed_step_to_handover_seconds"] is not None
                     and out["last_completed_step_to_handover_seconds"] <= 60)
        return out
    # Detection in steps is the job's: from the first step after the fault to the exchange window
    # that named the failed node (a trip before the fault is a false straggler, not a detection).
    # The daemon acts on that report at its next poll, a second later at most: reported as the
    # steps to the trip, not judged (at a slower step a second holds fewer steps).
    windows = [e for e in events if e["event"] == "exchange"]
    fault_step = next((s for t, s in steps if t >= t_fault), None)
    named = next((e for e in windows if e["time"] >= t_fault and failed in (e.get("stragglers") or ())), None)
    out["steps_to_detect"] = named["step"] - fault_step if named and fault_step is not None else None
    out["steps_to_trip"] = sum(1 for t, _ in steps if t_fault <= t <= tripped) if tripped and tripped > t_fault else None
    out["named_to_trip_seconds"] = round(tripped - named["time"], 3) if named and tripped else None
    out["step_seconds_slowed"] = _med([b - a for (a, _), (b, _) in gaps if tripped and t_fault <= a and b <= tripped])
    out["cause_named"] = "hw_slowdown" in str(mig.get("reason", ""))
    b, a = out["step_seconds_before"], out["step_seconds_after"]
    out["after_over_before"] = round(a / b, 3) if a and b else None  # the wall clock: reported, not judged
    failed_rel = _med(relative_compute([e for e in windows if t_fault <= e["time"] <= (tripped or t_fault)], failed))
    replaced = relative_compute([e for e in windows if t_first is not None and e["time"] >= t_first], replacement)
    out["failed_relative_compute"] = round(failed_rel, 3) if failed_rel is not None else None
    out["replacement"] = replacement
    out["replacement_windows"] = len(replaced)
    out["replacement_relative_compute"] = round(_med(replaced), 3) if replaced else None
    out["relative_threshold"] = RELATIVE_THRESHOLD
    out["ok"] = (mig.get("rule") == "straggler" and tripped is not None and tripped > t_fault
                 and out["steps_to_detect"] is not None and out["steps_to_detect"] <= 20 and out["cause_named"]
                 and out["replacement_relative_compute"] is not None
                 and out["replacement_relative_compute"] < RELATIVE_THRESHOLD)
    return out
