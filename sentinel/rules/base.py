"""What a policy rule is, and what it evaluates over.

A rule is one module in ``sentinel/rules/`` that defines ``RULE``, an instance of :class:`GpuRule`
or :class:`NodeRule`. It declares

* ``name``: what ``policy.disabled_rules``, trips and ``sentinel_policy_trips_total{rule}`` call it;
* ``fields``: the NVML fields it needs; on a GPU where one is unsupported the rule is inactive;
* ``counters``: the monotonic fields whose previous value it reads (``ctx.increase``); the policy
  remembers them between polls and treats one going backwards as a counter reset;
* ``config``: the ``PolicyConfig`` attributes it reads, each with its default and the default's
  source (a test checks they exist on ``PolicyConfig`` with these defaults);
* ``order``: its place among the trips of one poll (the first of the strongest action is the one
  the job is told about); unique across rules;
* its documentation, as the class docstring: the condition, the action, and why;

and a pure ``evaluate``: no I/O, no clock (``ctx.now`` is the poll's time), no module state.

This module imports nothing of Sentinel's but the readings, so ``sentinel.config`` can take the rule
names from the registry without importing the policy. The ``PolicyConfig`` a rule receives is
passed in, never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from sentinel.readings import GpuReading, KernelEvent, XidEvent

if TYPE_CHECKING:
    from sentinel.config import PolicyConfig

ACTIONS = ("alert", "snapshot", "migrate")


@dataclass(frozen=True)
class ConfigKey:
    """A ``PolicyConfig`` attribute a rule reads, its default, and where that default comes from."""

    name: str
    default: object
    source: str


# Keys several rules read; declared once so that their sources agree.
DEBOUNCE_SAMPLES = ConfigKey(
    "debounce_samples", 3,
    "Sentinel: a condition must hold on 3 polls in a row (DCGM's health watches also need a repeat)")
LEAD_TIME_SECONDS = ConfigKey(
    "lead_time_seconds", 600.0,
    "Sentinel: 10 minutes covers a full snapshot of a large job to a shared filesystem plus the drain")


@dataclass(frozen=True)
class Finding:
    """What a rule found: the policy turns it into a ``policy.Trip`` for this GPU (or node),
    after the rule's activity, cooldown and health bookkeeping."""

    action: str  # "alert" | "snapshot" | "migrate"
    cause: str  # the rule plus its target, for cooldowns ("xid:79", "trend:retired_pages")
    message: str
    values: Mapping[str, float] = field(default_factory=dict)
    forecast_seconds: float | None = None
    lead_time_seconds: float | None = None


@dataclass(frozen=True)
class XidVerdict:
    """One accepted Xid event after the policy's bucket lookup (catalog, overrides, skip list).

    ``action`` is the configured or catalog action, None when the Xid is in no bucket.
    ``per_hour`` is set only for an application Xid with no override: how many such Xids this GPU
    had in the last hour, this one included."""

    event: XidEvent
    action: str | None
    per_hour: int | None = None


class GpuContext:
    """One GPU at one poll, as the rules see it.

    The policy builds it from the GPU's state and reading, runs every GPU rule over it in order,
    and folds what the rules left in it back into the GPU's next state. Rules read ``reading``,
    ``values``, ``xids``, ``now``; they keep memory between polls only through the helpers and the
    mutable mappings here (``streaks``, ``short``, ``tracks``, ``memory``), never in themselves.
    """

    def __init__(self, reading: GpuReading, now: float, *, xids: tuple[XidVerdict, ...] = (),
                 previous: Mapping[str, float] | None = None, streaks: dict[str, int] | None = None,
                 short: dict[str, tuple[tuple[float, float], ...]] | None = None, tracks: dict[str, Any] | None = None,
                 memory: dict[str, Any] | None = None, active: frozenset[str] = frozenset()) -> None:
        self.reading = reading
        self.values = reading.values
        self.gpu = reading.index
        self.now = now
        self.xids = xids
        self.active = active  # the rules that can trip on this GPU now (an inactive rule still runs)
        self.previous = previous if previous is not None else {}  # counters at the last complete poll
        self.streaks = streaks if streaks is not None else {}  # cause -> consecutive polls it held
        self.short = short if short is not None else {}  # name -> (time, value) samples, ~last minute
        self.tracks = tracks if tracks is not None else {}  # trend target -> Track
        self.memory = memory if memory is not None else {}  # rule name -> that rule's own immutable memory
        self.watching: set[str] = set()  # causes that hold the GPU in WATCH without a trip
        self.forecast_seconds: float | None = None  # the soonest forecast any rule made this poll

    def increase(self, counter: str) -> float:
        """How much a monotonic counter (declared in the rule's ``counters``) grew since the last
        poll; 0 when either value is missing or the counter was reset."""
        if counter not in self.values or counter not in self.previous:
            return 0.0
        return max(0.0, self.values[counter] - self.previous[counter])

    def sustained(self, cause: str, condition: bool, samples: int) -> bool:
        """Debounce: True once ``condition`` has held on ``samples`` polls in a row."""
        self.streaks[cause] = self.streaks.get(cause, 0) + 1 if condition else 0
        return self.streaks[cause] >= samples

    def window_rate(self, name: str, value: float | None, span: float = 60.0) -> float | None:
        """Per-second rate of ``value`` over the last ``span`` seconds of samples; None without two
        samples at different times. A None ``value`` (not read this poll) records nothing."""
        if value is None:
            return None
        hist = tuple(p for p in self.short.get(name, ()) if self.now - p[0] <= span) + ((self.now, value),)
        self.short[name] = hist[-128:]
        if len(hist) < 2 or hist[-1][0] - hist[0][0] <= 0:
            return None
        return (hist[-1][1] - hist[0][1]) / (hist[-1][0] - hist[0][0])

    def watch(self, cause: str) -> None:
        """Hold the GPU in WATCH (and keep it from counting a clean poll) without tripping."""
        self.watching.add(cause)

    def forecast(self, seconds: float | None) -> None:
        """Report a forecast time to failure; the GPU's state keeps the soonest of the poll."""
        if seconds is not None and (self.forecast_seconds is None or seconds < self.forecast_seconds):
            self.forecast_seconds = seconds


class Rule:
    """Common declarations; see the module docstring. Subclass :class:`GpuRule` or :class:`NodeRule`."""

    name: str = ""
    scope: str = ""
    fields: tuple[str, ...] = ()
    counters: tuple[str, ...] = ()
    config: tuple[ConfigKey, ...] = ()
    order: int = 0
    predicts: bool = False  # a migrate from this rule is a forecast (PREDICTED_FAILURE), not a failure

    def supported(self, gpu: GpuReading) -> bool:
        """False when a field this rule needs is unsupported on ``gpu``."""
        return not any(f in gpu.unsupported for f in self.fields)

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


class GpuRule(Rule):
    """A rule over one GPU's poll: counters, flags and the Xid events it brought.

    ``evaluate`` runs on every poll whether or not the rule is active on this GPU, so that its
    debounce streaks and rate windows stay continuous (a reload can enable it); what an inactive
    rule finds is dropped and does not hold the GPU in WATCH."""

    scope = "gpu"

    def evaluate(self, ctx: GpuContext, cfg: PolicyConfig) -> Iterable[Finding]:
        raise NotImplementedError


class NodeRule(Rule):
    """A rule over one kernel event that concerns the node (or a GPU's PCIe device). Each event is
    offered to the node rules in order; the first that returns a Finding claims it."""

    scope = "node"

    def evaluate(self, event: KernelEvent, cfg: PolicyConfig) -> Finding | None:
        raise NotImplementedError


def event_values(event: KernelEvent) -> dict[str, float]:
    """The numeric parts of a kernel event's detail, as a trip's values."""
    return {k: v for k, v in event.detail.items() if isinstance(v, (int, float))}
