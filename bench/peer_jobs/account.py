"""bench/peers.py's accounting, pure (tests/test_peers_bench.py checks it on made-up logs): what
one job's step log says about a fault, and the figures of a whole run.

A step line is ``{"event": "step", "step": s, "time": t, "writer": w, "participants": n}`` (a
Sentinel line has ``rank`` instead of ``writer`` and no ``participants``: its steps always have
the whole world). A step index a writer logs twice was computed twice: recomputed. A step
committed by fewer data-parallel replicas than the world is degraded (torchft goes on without
the dead groups' slices of the batch).
"""

from __future__ import annotations

import statistics


def slug(name: str) -> str:
    return name.replace("-", "_")


def _writer(e: dict) -> str:
    return e.get("writer") or f"rank{e.get('rank', 0)}"


def account(events: list[dict], t_fault: float, full: int) -> dict:
    """The fault's cost in one job's log: the step the job was at when it struck (the last step
    logged before it), fault -> first step after it, -> first step with the whole world again,
    the step the job resumed from, the step indices some writer computed more than once, the
    degraded step indices. The step a process was finishing when the fault struck is not
    progress after it: an index up to the next one (a writer behind the others logs the fault's
    own step late), logged by a process that logged before the fault, with
    the whole world, before that process logged a restart (an NVRx survivor restarts in its own
    process; a torchft survivor that goes on without the dead logs fewer participants)."""
    steps = sorted((e for e in events if e.get("event") == "step"), key=lambda e: e["time"])
    before = [e for e in steps if e["time"] <= t_fault]
    fault_step = max((e["step"] for e in before), default=None)
    old = {e.get("pid") for e in before}
    restarted = {}
    for e in events:
        if e.get("event") == "resumed" and e["time"] > t_fault:
            restarted[e.get("pid")] = min(e["time"], restarted.get(e.get("pid"), e["time"]))

    def in_flight(e: dict) -> bool:
        return (e.get("pid") in old and fault_step is not None and e["step"] <= fault_step + 1
                and e.get("participants", full) >= full and e["time"] < restarted.get(e.get("pid"), float("inf")))

    after = [e for e in steps if e["time"] > t_fault and not in_flight(e)]
    whole = [e for e in after if e.get("participants", full) >= full]
    resumed = [e["start"] for e in events if e.get("event") == "resumed" and e["time"] > t_fault and "start" in e]
    seen: dict[tuple[str, int], int] = {}
    for e in steps:
        key = (_writer(e), e["step"])
        seen[key] = seen.get(key, 0) + 1
    recomputed = sorted({s for (_, s), n in seen.items() if n > 1})
    degraded = sorted({e["step"] for e in steps if e.get("participants", full) < full})
    # where each rank ran before the fault and after it: a restart that hands ranks to other nodes
    # reorders the gradient sums (gloo's allreduce order follows the ranks): not bitwise, not wrong
    placed = {}
    for e in events:
        if e.get("event") == "resumed" and "rank" in e and "node" in e:
            placed.setdefault(e["time"] > t_fault, {})[e["rank"]] = e["node"]
    moved = sorted(r for r, n in placed.get(True, {}).items() if placed.get(False, {}).get(r, n) != n)
    return {"fault_step": fault_step, "ranks_moved": moved,
            "fault_to_first_step_seconds": round(after[0]["time"] - t_fault, 3) if after else None,
            "fault_to_full_world_seconds": round(whole[0]["time"] - t_fault, 3) if whole else None,
            "resumed_from": min(resumed) if resumed else None,
            "recomputed": recomputed, "recomputed_steps": len(recomputed),
            "degraded": degraded, "degraded_steps": len(degraded),
            "last_step": max((e["step"] for e in steps), default=None)}


def losses(events: list[dict]) -> dict[int, float]:
    """Step -> loss as the job's reporting writer (rank 0 / group 0) logged it last: after a
    recomputation, the value the job went on from."""
    out: dict[int, float] = {}
    for e in sorted((e for e in events if e.get("event") == "step" and "loss" in e), key=lambda e: e["time"]):
        if _writer(e) in ("rank0", "group0"):
            out[e["step"]] = float(e["loss"])
    return out


def loss_deviation(events: list[dict], reference: dict[int, float] | None, t_fault: float) -> float | None:
    """The loss curve's largest deviation from the uninterrupted run's after the fault: max over the
    steps logged after it of |loss - reference loss| (the logs keep 6 decimals: 0 means equal to
    that resolution). None without a reference or a common step."""
    if not reference:
        return None
    after = losses([e for e in events if e.get("time", 0) > t_fault])
    common = [s for s in after if s in reference]
    return max((abs(after[s] - reference[s]) for s in common), default=None)


def _median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


# the loop with no fault tolerance each system's steady-state step time is divided by
BASELINE = {"sentinel": "none_fsdp"}


# the phases of a run, each with its own figures: quiet (the figures' plain names), loaded (beside
# bench/peers.py --load's busy loops: the same names after "peers_loaded_")
PHASES = {"quiet": "peers_", "loaded": "peers_loaded_"}


def summarise(runs: list[dict]) -> dict[str, float | None]:
    """Figures (bench/_report.py names) from every run so far, per phase (a run without one is
    quiet): per system and fault the medians of the cells that finished, per system its steady
    state against its baseline, each peer's figure over Sentinel's from the same phase of the same
    run, and the phase's median 1-minute load average (``<prefix>load_average_ratio``)."""
    fig: dict[str, float | None] = {}
    for phase, pre in PHASES.items():
        rs = [r for r in runs if r.get("phase", "quiet") == phase]
        if rs:
            fig.update(_phase_figures(rs, pre))
            loads = [r["loadavg"][0] for r in rs if r.get("loadavg")]
            if loads:
                fig[pre + "load_average_ratio"] = _median(loads)
    return fig


def _phase_figures(runs: list[dict], pre: str) -> dict[str, float | None]:
    """One phase's figures, named ``pre + <system>_...``."""
    fig: dict[str, float | None] = {}
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r.get("kind") == "cell":
            cells.setdefault((r["system"], r["fault"]), []).append(r)
    for (system, fault), rs in cells.items():
        ok = [r for r in rs if r.get("ok")]
        p = f"{pre}{system}_{slug(fault)}_"
        fig[p + "ok_fraction"] = len(ok) / len(rs)
        fig[p + "runs_count"] = len(rs)
        if not ok:
            continue
        fig[p + "fault_to_first_step_seconds"] = _median([r["fault_to_first_step_seconds"] for r in ok
                                                          if r.get("fault_to_first_step_seconds") is not None])
        fig[p + "fault_to_full_world_seconds"] = _median([r["fault_to_full_world_seconds"] for r in ok
                                                          if r.get("fault_to_full_world_seconds") is not None])
        fig[p + "recomputed_steps"] = _median([r["recomputed_steps"] for r in ok])
        fig[p + "max_recomputed_steps"] = max(r["recomputed_steps"] for r in ok)
        fig[p + "degraded_steps"] = _median([r["degraded_steps"] for r in ok])
        fig[p + "bitwise_equal_fraction"] = sum(bool(r.get("bitwise")) for r in ok) / len(ok)
        devs = [r["loss_deviation"] for r in ok if r.get("loss_deviation") is not None]
        if devs:
            fig[p + "max_loss_deviation"] = max(devs)
    steady: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("kind") == "steady" and r.get("ok"):
            steady.setdefault(r["system"], []).append(r)
    for system, rs in steady.items():
        fig[f"{pre}{system}_step_seconds"] = _median([r["step_seconds"] for r in rs])
        fig[f"{pre}{system}_peak_rss_bytes"] = _median([r["peak_rss_bytes"] for r in rs])
    for system in steady:
        base = BASELINE.get(system, "none")
        if system.startswith("none") or base not in steady:
            continue
        fig[f"{pre}{system}_step_over_baseline_ratio"] = (fig[f"{pre}{system}_step_seconds"]
                                                           / fig[f"{pre}{base}_step_seconds"])
        fig[f"{pre}{system}_extra_peak_rss_bytes"] = (fig[f"{pre}{system}_peak_rss_bytes"]
                                                       - fig[f"{pre}{base}_peak_rss_bytes"])
    for (system, fault) in cells:
        if system == "sentinel":
            continue
        for what in ("fault_to_first_step_seconds", "fault_to_full_world_seconds"):
            num, den = fig.get(f"{pre}{system}_{slug(fault)}_{what}"), fig.get(f"{pre}sentinel_{slug(fault)}_{what}")
            if num and den:
                fig[f"{pre}{system}_over_sentinel_{slug(fault)}_{what.removesuffix('_seconds')}_ratio"] = num / den
    return fig
