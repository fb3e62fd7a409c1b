"""Stragglers: how slow each node is, why, and whether handing it over pays. Pure logic.

In synchronous training every rank waits for the slowest, so the *step* time is the same
everywhere; what differs is each rank's *compute* time (from the start of its step to the moment
it entered the step's last collective; see :mod:`trainer.progress`). Two scores per node, over a
window of recent steps:

* **relative** — the node's median compute time over the job's median across nodes: 1.5 means
  this node computes 50 % slower than the typical node *now* (a thermal or power brake, a
  degraded link, a noisy neighbour). Immune to a job-wide slowdown (a bigger batch, a slower
  phase): every node moves together.
* **individual** — the node's median compute time over its own best window median: catches a
  node that got slower than itself even when the whole job is small (two nodes) or all slow.

A node is a straggler when its relative score reaches ``relative_threshold`` in ``min_windows``
(3) consecutive windows (one or two noisy windows are not a straggler). The individual score is
reported with it, not acted on: it swings with the machine's load. Steps that are not comparable are left
out before scoring: the first ``warmup_steps`` after a (re)start (compile, caches, allocator) and
steps that took a snapshot (their stall is the guard's, on every rank alike).

:func:`causes` joins the score with the node's hardware readings — NVML clock-event reasons
(hardware slowdown, power brake, thermal, software power cap), PCIe replays per minute and a link
narrower than its maximum, NVLink replay/recovery/CRC errors per minute — so the report says *why*.

:func:`decide` acts only when it pays: hand the node over when the time it would cost the job if
it stayed, ``(slowdown - 1) x step seconds x steps left``, exceeds the measured cost of a
hand-over (detection to first step on the spare, plus the steps lost), else alert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable, Mapping, Sequence

# NVML clocks-event reason bits (nvml.h, nvmlClocksEventReason*).
CLOCK_EVENT_REASONS: Mapping[int, str] = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake",
}
# Reasons that slow a busy GPU down on their own; idle (0x1), application clocks (0x2), sync
# boost (0x10) and display clocks (0x100) are not a fault.
SLOWDOWN_BITS = sum(CLOCK_EVENT_REASONS)


class StragglerConfigError(ValueError):
    """A straggler setting out of range; the message names the key."""


@dataclass(frozen=True)
class StragglerSettings:
    window_steps: int = 10
    min_windows: int = 3
    relative_threshold: float = 1.3
    individual_threshold: float = 1.3
    warmup_steps: int = 20
    pcie_replays_per_minute: float = 10.0
    nvlink_errors_per_minute: float = 10.0

    def __post_init__(self) -> None:
        for key in ("window_steps", "min_windows", "warmup_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "warmup_steps" else 1):
                raise StragglerConfigError(f"straggler.{key} must be an integer >= {0 if key == 'warmup_steps' else 1} (got {v!r})")
        for key in ("relative_threshold", "individual_threshold"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 1.0:
                raise StragglerConfigError(f"straggler.{key} must be a number > 1 (got {v!r})")
        for key in ("pcie_replays_per_minute", "nvlink_errors_per_minute"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise StragglerConfigError(f"straggler.{key} must be a number >= 0 (got {v!r})")


@dataclass(frozen=True)
class StepSample:
    """One rank's view of one step."""

    step: int
    compute_seconds: float
    step_seconds: float
    snapshot: bool = False  # the guard took a snapshot at this step
    since_start: int = 0  # steps since this process (re)started, this one included


def comparable(samples: Iterable[StepSample], settings: StragglerSettings) -> list[StepSample]:
    """The samples fit for scoring: not in the warm-up after a (re)start, not a snapshot step,
    with a finite positive compute time."""
    return [s for s in samples if s.since_start > settings.warmup_steps and not s.snapshot
            and math.isfinite(s.compute_seconds) and s.compute_seconds > 0]


@dataclass(frozen=True)
class Score:
    node: str
    relative: float  # node median compute / median over nodes
    individual: float  # node median compute / its own best window median
    compute_seconds: float
    job_median_seconds: float


def window_scores(compute: Mapping[str, Sequence[float]], best: Mapping[str, float] | None = None) -> dict[str, Score]:
    """Scores of one window: ``compute`` maps node -> the compute seconds of its ranks' comparable
    steps in the window (a node's slowest rank is what every rank waits for, so pass the per-step
    maximum over the node's ranks). ``best`` maps node -> its best earlier window median. Nodes
    without samples are left out."""
    med = {n: median(xs) for n, xs in compute.items() if xs}
    if not med:
        return {}
    job = median(med.values())
    out = {}
    for n, m in med.items():
        b = min(m, (best or {}).get(n, m))
        out[n] = Score(n, m / job if job > 0 else 1.0, m / b if b > 0 else 1.0, m, job)
    return out


@dataclass
class StragglerTracker:
    """Feeds windows in, keeps each node's best window and its run of slow windows. Pure state:
    no clock, no I/O. ``observe`` returns the nodes that are stragglers after this window."""

    settings: StragglerSettings = field(default_factory=StragglerSettings)
    best: dict[str, float] = field(default_factory=dict)
    slow_runs: dict[str, int] = field(default_factory=dict)
    last: dict[str, Score] = field(default_factory=dict)

    def observe(self, compute: Mapping[str, Sequence[float]]) -> list[Score]:
        scores = window_scores(compute, self.best)
        self.last = scores
        out = []
        for n, s in scores.items():
            self.best[n] = min(self.best.get(n, s.compute_seconds), s.compute_seconds)
            # The relative score decides: the individual one swings with the machine's load (a
            # 2-CPU host at load 50 showed 2.7x "its own best" on a healthy node); it is reported.
            slow = s.relative >= self.settings.relative_threshold
            self.slow_runs[n] = self.slow_runs.get(n, 0) + 1 if slow else 0
            if self.slow_runs[n] >= self.settings.min_windows:
                out.append(s)
        return out

    def forget(self, node: str) -> None:
        """A node left (handed over): its history goes with it."""
        self.best.pop(node, None)
        self.slow_runs.pop(node, None)
        self.last.pop(node, None)


# A link straggler is judged by the same rule (min_windows windows in a row at or above a
# threshold of the job's median), on a node's link time instead of its compute time. Its own
# threshold: a link measured on a busy host swings more than a compute time, and a degraded link
# is not 30 % slower but several times (a 100 Gb/s port at 25 Gb/s; tc tbf in the drill: ~50x).
LINK_RELATIVE_THRESHOLD = 3.0


def node_link_seconds(links: Iterable[tuple[str, str, float]]) -> dict[str, float]:
    """Per node its link time from the links measured between nodes: ``(from node, to node,
    seconds per MB)`` (the memory tier's replica of each rank, timed by the rank receiving it). A
    host whose own link is slow slows every link into it and out of it; its ring neighbours see
    only one of theirs slow. So a node's link time is the faster of its slowest link in and its
    slowest link out; a node without a link measured both ways is left out. With two nodes both
    see the same one slow link and neither stands out: it takes three to tell which end is slow."""
    into: dict[str, float] = {}
    out: dict[str, float] = {}
    for src, dst, seconds in links:
        if src == dst or not math.isfinite(seconds) or seconds <= 0:
            continue
        into[dst] = max(into.get(dst, 0.0), seconds)
        out[src] = max(out.get(src, 0.0), seconds)
    return {n: min(into[n], out[n]) for n in into if n in out}


@dataclass(frozen=True)
class GpuEvidence:
    """What the daemon read about one GPU: its clock-event reasons now, and counter deltas over
    ``minutes`` (PCIe replays, NVLink errors), the PCIe link width now and at its best."""

    gpu: int
    clock_event_reasons: int | None = None
    pcie_replays: float | None = None
    pcie_link_width: float | None = None
    pcie_link_width_max: float | None = None
    nvlink_errors: float | None = None
    minutes: float = 1.0


def causes(evidence: Iterable[GpuEvidence], settings: StragglerSettings = StragglerSettings()) -> list[str]:
    """Why a node is slow, from its GPUs' readings: e.g. ``["GPU 3: hw_slowdown", "GPU 3: PCIe
    x8 of x16"]``. Empty when the hardware shows nothing (then the report says so: a noisy
    neighbour, the host, the input pipeline). A value that was not read is not a cause."""
    out: list[str] = []
    for g in evidence:
        if g.clock_event_reasons is not None:
            for bit, name in CLOCK_EVENT_REASONS.items():
                if int(g.clock_event_reasons) & bit:
                    out.append(f"GPU {g.gpu}: {name}")
        per_min = max(g.minutes, 1e-9)
        if g.pcie_replays is not None and g.pcie_replays / per_min >= settings.pcie_replays_per_minute > 0:
            out.append(f"GPU {g.gpu}: {g.pcie_replays / per_min:.0f} PCIe replays/min")
        if g.pcie_link_width is not None and g.pcie_link_width_max and g.pcie_link_width < g.pcie_link_width_max:
            out.append(f"GPU {g.gpu}: PCIe x{g.pcie_link_width:.0f} of x{g.pcie_link_width_max:.0f}")
        if g.nvlink_errors is not None and g.nvlink_errors / per_min >= settings.nvlink_errors_per_minute > 0:
            out.append(f"GPU {g.gpu}: {g.nvlink_errors / per_min:.0f} NVLink errors/min")
    return out


@dataclass(frozen=True)
class Decision:
    action: str  # "migrate" | "alert"
    saving_seconds: float | None  # what keeping the node costs the rest of the run (None: unknown)
    cost_seconds: float
    why: str


def decide(relative: float, step_seconds: float, steps_left: int | None, handover_seconds: float,
           lost_steps: float = 1.0) -> Decision:
    """Hand over only when it pays. ``relative`` is the straggler's score (the job runs at its
    pace: a node at 1.5 makes every step 1.5x its healthy time, so ``step_seconds`` / relative is
    the healthy step). ``handover_seconds``: the measured trip-to-first-step of a hand-over;
    ``lost_steps``: the steps redone after it (the memory tier's one). Unknown steps left
    (``None``) never pays: alert."""
    if not (math.isfinite(relative) and relative > 0 and math.isfinite(step_seconds) and step_seconds >= 0):
        raise ValueError("relative and step_seconds must be finite, relative > 0")
    if handover_seconds < 0 or lost_steps < 0:
        raise ValueError("handover_seconds and lost_steps must be >= 0")
    healthy = step_seconds / max(relative, 1.0)
    cost = handover_seconds + lost_steps * healthy
    if steps_left is None:
        return Decision("alert", None, cost, "steps left unknown: cannot tell whether a hand-over pays")
    saving = (step_seconds - healthy) * max(steps_left, 0)
    if saving > cost:
        return Decision("migrate", saving, cost, f"saves {saving:.0f} s over {steps_left} steps left, "
                        f"hand-over costs {cost:.0f} s")
    return Decision("alert", saving, cost, f"would save {saving:.0f} s over {steps_left} steps left, "
                    f"less than the hand-over's {cost:.0f} s")
