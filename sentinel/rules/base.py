"""What a policy rule is, and what it evaluates over.

A rule is one module in ``sentinel/rules/`` that defines ``RULE``, an instance of :class:`GpuRule`
or :class:`NodeRule`. It declares

* ``name``: what ``policy.disabled_rules``, trips and ``sentinel_policy_trips_total{rule}`` call it;
* ``fields``: the NVML fields it needs; on a GPU where one is unsupported the rule is inactive;
* ``counters``: the monotonic fields whose previous value it reads (``ctx.increase``); the policy
  remembers them between polls and treats one going backwards as a counter reset;
* ``config``: the ``[policy]`` keys it reads (:class:`ConfigKey`: default, the default's source,
  range); ``sentinel.config`` makes ``PolicyConfig`` from these declarations, so a key's default and
  range are written nowhere else (a test checks ``systemd/sentinel.toml`` against them);
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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from sentinel import settings

from sentinel.readings import GpuReading, KernelEvent, XidEvent

if TYPE_CHECKING:
    from sentinel.config import PolicyConfig

ACTIONS = ("alert", "snapshot", "migrate")


@dataclass(frozen=True)
class ConfigKey:
    """A ``[policy]`` key a rule reads: its default, where that default comes from, and its range.

    A number is checked against [``low``, ``high``] (``(low, high]`` with ``low_open``); any other
    value by ``check(prefix, value)``, which raises :class:`sentinel.settings.ConfigError` naming
    the key. ``type`` is the value's type as ``PolicyConfig`` declares it (default: the default's)."""

    name: str
    default: object
    source: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    check: Callable[[str, Any], None] | None = None
    type: Any = None

    @property
    def hint(self) -> Any:
        return self.type or type(self.default)

    def validate(self, prefix: str, value: Any) -> None:
        """Raise ConfigError naming ``<prefix>.<name>`` unless ``value`` is in range."""
        if self.check is not None:
            self.check(prefix, value)
        elif self.hint is int:
            settings.integer(prefix, self.name, value, int(self.low), int(self.high))
        elif self.hint is float:
            settings.number(prefix, self.name, value, self.low, self.high, low_open=self.low_open)

    def range_text(self) -> str:
        """The range as ``systemd/sentinel.toml`` states it: ``1..10000``, ``0 < x <= 1e12``."""
        if self.low is None or self.high is None:
            return ""
        low, high = (_number_text(v) for v in (self.low, self.high))
        return f"{low} < x <= {high}" if self.low_open else f"{low}..{high}"

    def __post_init__(self) -> None:
        if self.hint in (int, float) and self.check is None and (self.low is None or self.high is None):
            raise TypeError(f"ConfigKey {self.name}: a number needs its range (low, high)")


def _number_text(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    mantissa, _, exponent = f"{value:e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


# Keys several rules read; declared once so that their sources agree.
DEBOUNCE_SAMPLES = ConfigKey(
    "debounce_samples", 3,
    "Sentinel: a condition must hold on 3 polls in a row (DCGM's health watches also need a repeat)", 1, 10_000)
LEAD_TIME_SECONDS = ConfigKey(
    "lead_time_seconds", 600.0,
    "Sentinel: 10 minutes covers a full snapshot of a large job to a shared filesystem plus the drain",
    0, 7 * settings.DAY, low_open=True)


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
    had in the last hour, this one included (exact up to ``app_xid_max_per_hour`` + 1; past the
    limit, a lower bound that is still past it: see ``Policy._classify_xids``)."""

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
        old = self.short.get(name, ())
        start = 0  # the samples are in time order: only the oldest can have left the span
        while start < len(old) and self.now - old[start][0] > span:
            start += 1
        hist = old[start:] + ((self.now, value),)
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
    rated = False  # a rated rule keeps a rate of the events it claims (the policy holds its history)

    def evaluate(self, event: KernelEvent, cfg: PolicyConfig) -> Finding | None:
        raise NotImplementedError

    def rate_key(self, event: KernelEvent) -> str | None:
        """A rated rule: the history an event counts in, ``""`` for one it claims uncounted, None if not its."""
        return None

    def evaluate_rate(self, event: KernelEvent, cfg: PolicyConfig, history: tuple, now: float
                      ) -> tuple[Finding | None, tuple]:
        """A rated rule: (a Finding or None, the new history) for one event it claims."""
        raise NotImplementedError


def event_values(event: KernelEvent) -> dict[str, float]:
    """The numeric parts of a kernel event's detail, as a trip's values."""
    return {k: v for k, v in event.detail.items() if isinstance(v, (int, float))}
