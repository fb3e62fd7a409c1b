"""Failure policy: pure decisions, ``decide(state, readings, now) -> (new_state, trips)``.

No I/O and no clock reads: the caller passes ``now`` (seconds, any monotonic origin). The rules
are modules of ``sentinel.rules`` (each with its fields, config keys, defaults and their sources);
this module runs them and owns what they share: counter resets, Xid deduplication, buckets and
application-Xid counting, cooldowns, health and hysteresis. ``docs/policy.md`` has the overview.

Every trip carries its explanation (rule, GPU, values, forecast, lead time) and an action:

* ``alert``    — tell humans (metrics, logs); the job is untouched.
* ``snapshot`` — ask the job to checkpoint now.
* ``migrate``  — snapshot, then drain this node so a spare takes over.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from sentinel.config import PolicyConfig
from sentinel.readings import GpuReading, NodeReadings, XidEvent
from sentinel.rules import REGISTRY
from sentinel.rules.base import GpuContext, GpuRule, NodeRule, Rule, XidVerdict
from sentinel.rules.trend import TREND_TARGETS, Track, theil_sen
from sentinel.rules.xid import XID_APPLICATION, XID_MIGRATE, XID_SNAPSHOT, action_table

__all__ = [
    "ACTION_RANK", "RULES", "TREND_TARGETS", "XID_APPLICATION", "XID_MIGRATE", "XID_SNAPSHOT", "GpuState", "Health",
    "Policy", "PolicyState", "Track", "Trip", "dedupe_xids", "rule_fields_supported", "theil_sen",
]


class Health(enum.IntEnum):
    """Health of one GPU.

    Transitions (``decide`` is the only writer):

    * HEALTHY -> WATCH: an ``alert``/``snapshot`` rule tripped, a trend forecast fell under
      2 x lead time, or a first NVML-hung sample.
    * WATCH -> HEALTHY: ``debounce_samples`` consecutive complete, clean polls (hysteresis; a
      poll with missing fields is not clean — missing is never evidence of health).
    * HEALTHY/WATCH -> PREDICTED_FAILURE: a trend forecast stayed under ``lead_time_seconds``
      for ``debounce_samples`` polls (action ``migrate``).
    * any -> FAILED: a hard-failure rule (fatal Xid, new uncorrectable ECC, remap failure,
      GPU lost, retired-page limits, ...) tripped (action ``migrate``).
    * PREDICTED_FAILURE and FAILED are sticky: only a daemon restart or an operator clears them
      (the node is cordoned by then; ``sentinel uncordon`` clears them in the running daemon,
      :meth:`Policy.returned_to_service`).
    """

    HEALTHY = 0
    WATCH = 1
    PREDICTED_FAILURE = 2
    FAILED = 3


ACTION_RANK = {"alert": 0, "snapshot": 1, "migrate": 2}

# rule -> fields it needs; a rule whose fields are unsupported on a GPU is inactive there.
# Derived from the rule modules in sentinel/rules/ (one module per rule).
RULES: Mapping[str, tuple[str, ...]] = MappingProxyType({rule.name: rule.fields for rule in REGISTRY})

XID_DEDUP_SECONDS = 5.0
APP_XID_WINDOW_SECONDS = 3600.0
# Monotonic counters a reset (driver reload, GPU reset) is detected on: those the rules declare,
# plus two no rule reads but that a reload zeroes with the rest (a reset is counted either way).
RESET_EVIDENCE = ("ecc_corrected_volatile", "remapped_rows_correctable")


NODE = -1  # Trip.gpu of a trip about the whole node rather than one GPU


@dataclass(frozen=True)
class Trip:
    rule: str
    action: str
    gpu: int  # the GPU's index, or NODE for a trip about the whole node (a rank signal, host memory)
    cause: str  # the rule plus its target, for cooldowns ("xid:79", "trend:retired_pages")
    message: str
    values: Mapping[str, float] = field(default_factory=dict)
    forecast_seconds: float | None = None
    lead_time_seconds: float | None = None

    @property
    def where(self) -> str:
        """"GPU 3" or "node": what a human reads in a request reason or a cordon marker."""
        return "node" if self.gpu == NODE else f"GPU {self.gpu}"

    def as_log(self) -> dict[str, object]:
        return {
            "event": "policy_trip",
            "rule": self.rule,
            "action": self.action,
            "gpu": self.gpu,
            "cause": self.cause,
            "message": self.message,
            "values": dict(self.values),
            "forecast_seconds": None if self.forecast_seconds is None else round(self.forecast_seconds, 1),
            "lead_time_seconds": self.lead_time_seconds,
        }


@dataclass(frozen=True)
class GpuState:
    health: Health = Health.HEALTHY
    last: Mapping[str, float] = field(default_factory=dict)
    tracks: Mapping[str, Track] = field(default_factory=dict)
    short: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # last ~60 s
    streaks: Mapping[str, int] = field(default_factory=dict)
    clean_polls: int = 0
    cooldown_until: Mapping[str, float] = field(default_factory=dict)
    # (time, count) runs of this GPU's application Xids in the last hour, oldest first, kept only as
    # far back as the rate decision needs (see Policy._classify_xids): bounded in an Xid storm
    app_xids: tuple[tuple[float, int], ...] = ()
    memory: Mapping[str, object] = field(default_factory=dict)  # rule name -> that rule's own memory
    forecast_seconds: float | None = None
    resets: int = 0


@dataclass(frozen=True)
class PolicyState:
    gpus: Mapping[int, GpuState] = field(default_factory=dict)
    # (gpu, xid) -> source -> when it last reported that Xid, within XID_DEDUP_SECONDS (for dedup)
    recent_xids: Mapping[tuple[int, int], Mapping[str, float]] = field(default_factory=dict)
    node_cooldown: Mapping[str, float] = field(default_factory=dict)
    # gpu -> Xid -> count, over every source, each Xid counted once (the one de-duplication pass;
    # the daemon exports these)
    xid_counts: Mapping[int, Mapping[int, int]] = field(default_factory=dict)
    # a rated node rule's cause -> its history ((bucket start, count), ...): corrected-error rates
    node_rates: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)


def dedupe_xids(recent: Mapping[tuple[int, int], Mapping[str, float]], events: Iterable[XidEvent], now: float
                ) -> tuple[Mapping[tuple[int, int], Mapping[str, float]], list[XidEvent]]:
    """Drop an Xid already reported for the same GPU by another source (NVML's event set and the
    kernel log both report every Xid) within XID_DEDUP_SECONDS. Returns (new recent, accepted).
    Constant work per event (a look-up by GPU and Xid): a storm of thousands costs no more each."""
    fresh: dict[tuple[int, int], dict[str, float]] = {}
    for key, by_source in recent.items():
        kept = {src: t for src, t in by_source.items() if now - t < XID_DEDUP_SECONDS}
        if kept:
            fresh[key] = kept
    accepted = []
    for ev in events:
        if ev.gpu is None:
            continue
        seen = fresh.setdefault((ev.gpu, ev.xid), {})
        if any(src != ev.source for src in seen):
            continue
        seen[ev.source] = now
        accepted.append(ev)
    return MappingProxyType(fresh), accepted


def rule_fields_supported(rule: str, gpu: GpuReading) -> bool:
    needed = RULES[rule]
    return not any(f in gpu.unsupported for f in needed)


class Policy:
    """Holds the configuration and the rules; ``decide`` is pure.

    ``rules`` defaults to the registry (every module in ``sentinel/rules/``); tests pass their own."""

    def __init__(self, config: PolicyConfig, rules: Sequence[Rule] = REGISTRY) -> None:
        self.cfg = config
        self.rules = tuple(rules)
        self.gpu_rules = tuple(r for r in self.rules if isinstance(r, GpuRule))
        self.node_rules = tuple(r for r in self.rules if isinstance(r, NodeRule))
        self.predicting = frozenset(r.name for r in self.rules if r.predicts)
        self.counters = tuple(dict.fromkeys(RESET_EVIDENCE + tuple(c for r in self.gpu_rules for c in r.counters)))
        self._active_cache: dict[tuple[int, frozenset[str]], dict[tuple[str, int], bool]] = {}
        self._active_names_cache: dict[tuple[int, frozenset[str]], frozenset[str]] = {}
        self.xid_action: dict[int, str] = action_table(config.xid_overrides, config.xid_skip)

    def rule_active(self, gpu: GpuReading) -> dict[tuple[str, int], bool]:
        key = (gpu.index, gpu.unsupported)
        cached = self._active_cache.get(key)
        if cached is None:
            cached = {
                (rule.name, gpu.index): rule.name not in self.cfg.disabled_rules and rule.supported(gpu)
                for rule in self.rules
            }
            self._active_cache[key] = cached
        return cached

    def _active_names(self, gpu: GpuReading) -> frozenset[str]:
        """The rules active on this GPU (made once per GPU and support set, as rule_active is)."""
        key = (gpu.index, gpu.unsupported)
        names = self._active_names_cache.get(key)
        if names is None:
            names = self._active_names_cache[key] = frozenset(
                rule for (rule, _), on in self.rule_active(gpu).items() if on)
        return names

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def returned_to_service(state: PolicyState) -> PolicyState:
        """The operator returned the node to service: every GPU is healthy again and no cooldown
        holds back the next trip; what the rules remember of the counters (the last values, the
        trends) and the Xid counts stay, so only a new error trips and no counter goes back."""
        gpus = {i: dataclasses.replace(g, health=Health.HEALTHY, cooldown_until=MappingProxyType({}), clean_polls=0)
                for i, g in state.gpus.items()}
        return dataclasses.replace(state, gpus=MappingProxyType(gpus), node_cooldown=MappingProxyType({}))

    def decide(self, state: PolicyState, readings: NodeReadings, now: float) -> tuple[PolicyState, list[Trip]]:
        trips: list[Trip] = []
        gpus = dict(state.gpus)
        recent, accepted = dedupe_xids(state.recent_xids, readings.xid_events, now)
        events_by_gpu: dict[int, list[XidEvent]] = {}
        xid_counts = dict(state.xid_counts)
        for ev in accepted:
            events_by_gpu.setdefault(ev.gpu, []).append(ev)
        for index, events in events_by_gpu.items():  # one copy per GPU, not per event
            per_gpu = dict(xid_counts.get(index, {}))
            for ev in events:
                per_gpu[ev.xid] = per_gpu.get(ev.xid, 0) + 1
            xid_counts[index] = MappingProxyType(per_gpu)
        for reading in readings.gpus:
            prev = gpus.get(reading.index, GpuState())
            gpu_events = events_by_gpu.get(reading.index, [])
            if readings.events_only:
                if not gpu_events:
                    continue
                new, gpu_trips = self._decide_events_only(prev, reading, gpu_events, now)
            else:
                new, gpu_trips = self._decide_gpu(prev, reading, gpu_events, now)
            gpus[reading.index] = new
            trips.extend(gpu_trips)
        rates = dict(state.node_rates)
        node_trips, cooldown = self._decide_node(readings, dict(state.node_cooldown), now, rates)
        trips.extend(node_trips)
        for t in node_trips:  # a kernel event that migrates one GPU (fallen off the bus, no Xid) fails it
            if t.gpu != NODE and t.action == "migrate":
                gpus[t.gpu] = dataclasses.replace(gpus.get(t.gpu, GpuState()), health=Health.FAILED)
            elif t.gpu != NODE and t.rule == "corrected_rate":  # a rising corrected-error rate: watch it
                g = gpus.get(t.gpu, GpuState())
                gpus[t.gpu] = dataclasses.replace(g, health=max(g.health, Health.WATCH), clean_polls=0)
        return PolicyState(MappingProxyType(gpus), recent, MappingProxyType(cooldown), MappingProxyType(xid_counts),
                           MappingProxyType(rates)), trips

    def _decide_node(self, readings: NodeReadings, cooldown: dict[str, float], now: float,
                     rates: dict[str, tuple[tuple[float, int], ...]]) -> tuple[list[Trip], dict[str, float]]:
        """Kernel events that concern the node (or a GPU's PCIe device) rather than a counter: each
        goes to the first node rule that claims it (a rated rule claims its events and keeps their
        rate in ``rates``, a Finding or not). An alert never cools its cause down, except a rate's."""
        trips = []
        for ev in readings.kernel_events:
            found = None
            for rule in self.node_rules:
                if rule.rated:
                    key = rule.rate_key(ev) if rule.name not in self.cfg.disabled_rules else None
                    if key is None:
                        continue
                    found, history = rule.evaluate_rate(ev, self.cfg, rates.get(key, ()), now)
                    if key:
                        rates[key] = history
                    break
                found = rule.evaluate(ev, self.cfg)
                if found is not None:
                    break
            if found is None:
                continue  # no rule claims it, or a rate below its threshold: nothing to do
            if rule.name in self.cfg.disabled_rules or cooldown.get(found.cause, -math.inf) > now:
                continue
            if found.action != "alert" or rule.rated:
                cooldown[found.cause] = now + self.cfg.cooldown_seconds
            gpu = ev.gpu if ev.gpu is not None else NODE
            trips.append(Trip(rule.name, found.action, gpu, found.cause, found.message, dict(found.values)))
        return trips, cooldown

    def _decide_events_only(self, st: GpuState, g: GpuReading, xids: list[XidEvent], now: float) -> tuple[GpuState, list[Trip]]:
        """Between polls: act on Xid events at once; counters wait for the next poll."""
        events_reading = GpuReading(index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, unsupported=g.unsupported,
                                    errors={"events_only": 0})
        new, trips = self._decide_gpu(
            dataclasses.replace(st, streaks=MappingProxyType({**st.streaks})), events_reading, xids, now)
        # keep every counter-based memory of the last full poll; take the Xid outcome only
        return dataclasses.replace(st, health=max(st.health, new.health), cooldown_until=new.cooldown_until,
                                   app_xids=new.app_xids, clean_polls=0), trips

    def _classify_xids(self, app_xids: tuple[tuple[float, int], ...], xids: list[XidEvent], now: float
                       ) -> tuple[tuple[XidVerdict, ...], tuple[tuple[float, int], ...]]:
        """Each Xid's bucket (catalog, overrides, skip list); application Xids with no override are
        counted over the last hour. Returns (verdicts, the new application-Xid runs).

        The runs are (time, count), one per decision that saw application Xids. Once the newer
        runs alone hold more than ``app_xid_max_per_hour``, the older ones are dropped: the count
        is then a lower bound, still over the limit, so the decision (over it or not) is the one
        the whole hour gives, now and later (the dropped runs are older than every kept one, so
        they would leave the hour first), and an Xid storm costs constant memory and work."""
        if not xids and not app_xids:
            return (), ()  # the common poll: nothing to classify, no run to age
        limit = self.cfg.app_xid_max_per_hour
        runs = tuple(r for r in app_xids if now - r[0] < APP_XID_WINDOW_SECONDS)
        counted = sum(n for _, n in runs)
        verdicts = []
        added = 0
        for ev in xids:
            action = self.xid_action.get(ev.xid)
            if action == "ignore":
                continue
            per_hour = None
            if ev.xid in XID_APPLICATION and action is None:
                added += 1
                per_hour = counted + added
            verdicts.append(XidVerdict(ev, action, per_hour))
        if added:
            runs += ((now, added),)
            total = counted + added
            while len(runs) > 1 and total - runs[0][1] > limit:
                total -= runs[0][1]
                runs = runs[1:]
        return tuple(verdicts), runs

    # ------------------------------------------------------------------------------------------
    def _decide_gpu(self, st: GpuState, g: GpuReading, xids: list[XidEvent], now: float) -> tuple[GpuState, list[Trip]]:
        cfg = self.cfg
        active = self._active_names(g)
        v = g.values
        last = dict(st.last)
        tracks = dict(st.tracks)
        short = dict(st.short)
        resets = st.resets
        complete = not g.hung and not g.lost and not g.errors

        # Counter resets (driver reload, GPU reset): any monotonic counter going backwards.
        for name in self.counters:
            if name in v and name in last and v[name] < last[name]:
                resets += 1
                tracks = {k: t for k, t in tracks.items() if name not in TREND_TARGETS[k][0]}
                short.pop(name, None)
                last.pop(name, None)

        verdicts, app_xids = self._classify_xids(st.app_xids, xids, now)
        ctx = GpuContext(g, now, xids=verdicts, previous=MappingProxyType(dict(last)), streaks=dict(st.streaks),
                         short=short, tracks=tracks, memory=dict(st.memory), active=active)
        candidates: list[Trip] = []
        failing: set[str] = set()  # conditions that currently hold (for hysteresis)
        for rule in self.gpu_rules:
            for found in rule.evaluate(ctx, cfg):  # always run to the end (no break): the rule's memory advances
                if rule.name not in active:
                    continue
                failing.add(found.cause)
                candidates.append(Trip(rule.name, found.action, g.index, found.cause, found.message,
                                       dict(found.values), found.forecast_seconds, found.lead_time_seconds))
        failing |= ctx.watching

        for name in self.counters:
            if name in v:
                last[name] = v[name]

        # -- cooldown, health ----------------------------------------------------------------
        cooldown = dict(st.cooldown_until)
        emitted: list[Trip] = []
        for t in candidates:
            if cooldown.get(t.cause, -math.inf) > now:
                continue
            cooldown[t.cause] = now + cfg.cooldown_seconds
            emitted.append(t)
        health = st.health
        if any(t.action == "migrate" and t.rule not in self.predicting for t in candidates):
            health = Health.FAILED
        elif any(t.action == "migrate" for t in candidates) and health < Health.PREDICTED_FAILURE:
            health = Health.PREDICTED_FAILURE
        elif (candidates or failing) and health < Health.PREDICTED_FAILURE:
            health = Health.WATCH
        clean = st.clean_polls + 1 if complete and not failing and not candidates else 0
        if health == Health.WATCH and clean >= cfg.debounce_samples:
            health = Health.HEALTHY
        new = GpuState(
            health=health,
            last=MappingProxyType(last),
            tracks=MappingProxyType(ctx.tracks),
            short=MappingProxyType(ctx.short),
            streaks=MappingProxyType(ctx.streaks),
            clean_polls=clean,
            cooldown_until=MappingProxyType(cooldown),
            app_xids=app_xids,
            memory=MappingProxyType(ctx.memory),
            forecast_seconds=ctx.forecast_seconds,
            resets=resets,
        )
        return new, emitted
