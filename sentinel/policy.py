"""Failure policy: pure decisions, ``decide(state, readings, now) -> (new_state, trips)``.

No I/O and no clock reads: the caller passes ``now`` (seconds, any monotonic origin). Defaults
and their sources are in ``docs/policy.md``.

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
from typing import Iterable, Mapping

from sentinel.config import PolicyConfig
from sentinel.readings import GpuReading, NodeReadings, XidEvent


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
      (the node is cordoned by then).
    """

    HEALTHY = 0
    WATCH = 1
    PREDICTED_FAILURE = 2
    FAILED = 3


ACTION_RANK = {"alert": 0, "snapshot": 1, "migrate": 2}

# rule -> fields it needs; a rule whose fields are unsupported on a GPU is inactive there.
RULES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "xid": (),
    "app_xid_rate": (),
    "ecc_uncorrected": ("ecc_uncorrected_volatile",),
    "retired_pages": ("retired_pages_sbe", "retired_pages_dbe"),
    "retired_dbe": ("retired_pages_dbe",),
    "retired_pending": ("retired_pages_pending",),
    "remap_failure": ("remapped_rows_failure",),
    "remap_pending": ("remapped_rows_pending",),
    "remap_uncorrectable": ("remapped_rows_uncorrectable",),
    "remap_availability": ("remap_histogram_low", "remap_histogram_none"),
    "pcie_replay_rate": ("pcie_replay", "pcie_link_gen", "pcie_link_width"),
    "nvlink_crc_rate": ("nvlink",),
    "gpu_lost": (),
    "nvml_hung": (),
    "thermal": ("temperature_celsius", "slowdown_temperature_celsius"),
    "trend": (),  # per target, see TREND_TARGETS
    "rank_signal": (),  # node level: fatal signals to training ranks (eBPF)
    "host_memory": (),  # node level: host memory-controller errors (eBPF ras:mc_event)
    "pcie_aer": (),  # PCIe AER errors on a GPU's device
})

# NVIDIA Xid catalog resolution buckets (docs/policy.md).
XID_MIGRATE = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 140})
XID_SNAPSHOT = frozenset({63, 94})
XID_APPLICATION = frozenset({13, 31, 43, 45})

# Trend targets: name -> (fields summed, threshold attribute of PolicyConfig, offset)
TREND_TARGETS: Mapping[str, tuple[tuple[str, ...], str, int]] = MappingProxyType({
    "retired_pages": (("retired_pages_sbe", "retired_pages_dbe"), "retired_pages_limit", 0),
    "retired_dbe": (("retired_pages_dbe",), "retired_dbe_limit", 1),
    "remapped_rows": (("remapped_rows_uncorrectable",), "remap_uncorrectable_limit", 0),
})

PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
TREND_POINTS = 64  # decimated history per counter
MIN_INCREASES = 3  # distinct increases in the window before a trend can forecast
XID_DEDUP_SECONDS = 5.0
WEEK = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Trip:
    rule: str
    action: str
    gpu: int
    cause: str  # the rule plus its target, for cooldowns ("xid:79", "trend:retired_pages")
    message: str
    values: Mapping[str, float] = field(default_factory=dict)
    forecast_seconds: float | None = None
    lead_time_seconds: float | None = None

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
class Track:
    """A monotonic counter's decimated history (for Theil–Sen) and its recent increases."""

    points: tuple[tuple[float, float], ...] = ()
    increases: tuple[float, ...] = ()
    below_lead: int = 0


@dataclass(frozen=True)
class GpuState:
    health: Health = Health.HEALTHY
    last: Mapping[str, float] = field(default_factory=dict)
    tracks: Mapping[str, Track] = field(default_factory=dict)
    short: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # last ~60 s
    streaks: Mapping[str, int] = field(default_factory=dict)
    clean_polls: int = 0
    cooldown_until: Mapping[str, float] = field(default_factory=dict)
    app_xids: tuple[float, ...] = ()
    dbe_increase_times: tuple[float, ...] = ()
    forecast_seconds: float | None = None
    resets: int = 0


@dataclass(frozen=True)
class PolicyState:
    gpus: Mapping[int, GpuState] = field(default_factory=dict)
    recent_xids: tuple[tuple[float, int, int, str], ...] = ()  # (time, gpu, xid, source) for dedup
    node_cooldown: Mapping[str, float] = field(default_factory=dict)


def theil_sen(points: Iterable[tuple[float, float]]) -> float:
    """Median of pairwise slopes: robust to bursts and outliers (29 % breakdown point)."""
    pts = list(points)
    slopes = []
    for i in range(len(pts)):
        t0, v0 = pts[i]
        for j in range(i + 1, len(pts)):
            t1, v1 = pts[j]
            if t1 > t0:
                slopes.append((v1 - v0) / (t1 - t0))
    if not slopes:
        return 0.0
    slopes.sort()
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def dedupe_xids(recent: tuple[tuple[float, int, int, str], ...], events: Iterable[XidEvent], now: float
                ) -> tuple[tuple[tuple[float, int, int, str], ...], list[XidEvent]]:
    """Drop an Xid already reported for the same GPU by another source (NVML's event set and the
    kernel log both report every Xid) within XID_DEDUP_SECONDS. Returns (new recent, accepted)."""
    recent = tuple(x for x in recent if now - x[0] < XID_DEDUP_SECONDS)
    accepted = []
    for ev in events:
        if ev.gpu is None:
            continue
        if any(g == ev.gpu and x == ev.xid and src != ev.source for _, g, x, src in recent):
            continue
        recent += ((now, ev.gpu, ev.xid, ev.source),)
        accepted.append(ev)
    return recent, accepted


def rule_fields_supported(rule: str, gpu: GpuReading) -> bool:
    needed = RULES[rule]
    return not any(f in gpu.unsupported for f in needed)


class Policy:
    """Holds the configuration; ``decide`` is pure."""

    def __init__(self, config: PolicyConfig) -> None:
        self.cfg = config
        self._active_cache: dict[tuple[int, frozenset[str]], dict[tuple[str, int], bool]] = {}
        self.xid_action: dict[int, str] = {}
        for xid in XID_MIGRATE:
            self.xid_action[xid] = "migrate"
        for xid in XID_SNAPSHOT:
            self.xid_action[xid] = "snapshot"
        for key, action in config.xid_overrides.items():
            self.xid_action[int(key)] = action
        for xid in config.xid_skip:
            self.xid_action[xid] = "ignore"

    def rule_active(self, gpu: GpuReading) -> dict[tuple[str, int], bool]:
        key = (gpu.index, gpu.unsupported)
        cached = self._active_cache.get(key)
        if cached is None:
            cached = {
                (rule, gpu.index): rule not in self.cfg.disabled_rules and rule_fields_supported(rule, gpu)
                for rule in RULES
            }
            self._active_cache[key] = cached
        return cached

    # ------------------------------------------------------------------------------------------
    def decide(self, state: PolicyState, readings: NodeReadings, now: float) -> tuple[PolicyState, list[Trip]]:
        trips: list[Trip] = []
        gpus = dict(state.gpus)
        recent, accepted = dedupe_xids(state.recent_xids, readings.xid_events, now)
        events_by_gpu: dict[int, list[XidEvent]] = {}
        for ev in accepted:
            events_by_gpu.setdefault(ev.gpu, []).append(ev)
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
        node_trips, cooldown = self._decide_node(readings, dict(state.node_cooldown), now)
        trips.extend(node_trips)
        return PolicyState(MappingProxyType(gpus), recent, MappingProxyType(cooldown)), trips

    def _decide_node(self, readings: NodeReadings, cooldown: dict[str, float], now: float) -> tuple[list[Trip], dict[str, float]]:
        """Kernel events that concern the node (or a GPU's PCIe device) rather than a counter."""
        trips = []
        for ev in readings.kernel_events:
            d = ev.detail
            gpu = ev.gpu if ev.gpu is not None else -1
            if ev.kind == "rank_signal":
                rule, cause = "rank_signal", f"rank_signal:{d.get('signal')}"
                # A SIGBUS is a memory failure only when its si_code says so: BUS_MCEERR_AR (4) or
                # BUS_MCEERR_AO (5), which only the kernel sends. Any other SIGBUS (kill -BUS, a
                # truncated mmap, a full /dev/shm) is the job's own business: an alert at most.
                memory_failure = d.get("signal") == "SIGBUS" and d.get("code") in (4, 5)
                action = "migrate" if memory_failure else "alert"
                if d.get("signal") == "SIGBUS":
                    cause = f"rank_signal:SIGBUS:{'memory_failure' if memory_failure else 'not_memory'}"
                msg = (f"{d.get('signal')} (si_code {d.get('code')}{', memory failure' if memory_failure else ''}) "
                       f"sent to training rank pid {d.get('pid')} ({d.get('comm')})")
            elif ev.kind == "mc_error" and d.get("type") in ("uncorrected", "fatal"):
                rule, cause, action = "host_memory", f"host_memory:{d.get('type')}", "snapshot"
                msg = f"{d.get('count')} {d.get('type')} host memory error(s) on memory controller {d.get('mc')}"
            elif ev.kind == "aer" and d.get("severity") in ("nonfatal", "fatal") and ev.gpu is not None:
                rule, cause, action = "pcie_aer", f"pcie_aer:{gpu}:{d.get('severity')}", "snapshot"
                msg = f"PCIe AER {d.get('severity')} error on {d.get('device')} (GPU {gpu})"
            else:
                continue
            if rule in self.cfg.disabled_rules or cooldown.get(cause, -math.inf) > now:
                continue
            if action != "alert":
                cooldown[cause] = now + self.cfg.cooldown_seconds
            trips.append(Trip(rule, action, gpu, cause, msg, {k: v for k, v in d.items() if isinstance(v, (int, float))}))
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

    # ------------------------------------------------------------------------------------------
    def _decide_gpu(self, st: GpuState, g: GpuReading, xids: list[XidEvent], now: float) -> tuple[GpuState, list[Trip]]:
        cfg = self.cfg
        active = {rule for (rule, _), on in self.rule_active(g).items() if on}
        v = g.values
        last = dict(st.last)
        streaks = dict(st.streaks)
        cooldown = dict(st.cooldown_until)
        tracks = dict(st.tracks)
        short = dict(st.short)
        resets = st.resets
        candidates: list[Trip] = []
        complete = not g.hung and not g.lost and not g.errors
        failing: set[str] = set()  # conditions that currently hold (for hysteresis)

        def trip(rule: str, action: str, cause: str, message: str, values: Mapping[str, float] | None = None,
                 forecast: float | None = None) -> None:
            if rule not in active:
                return
            failing.add(cause)
            candidates.append(Trip(rule, action, g.index, cause, message, dict(values or {}), forecast,
                                   cfg.lead_time_seconds if forecast is not None else None))

        def sustained(cause: str, condition: bool) -> bool:
            streaks[cause] = streaks.get(cause, 0) + 1 if condition else 0
            return streaks[cause] >= cfg.debounce_samples

        # Counter resets (driver reload, GPU reset): any monotonic counter going backwards.
        for name in ("ecc_corrected_volatile", "ecc_uncorrected_volatile", "retired_pages_sbe", "retired_pages_dbe",
                     "remapped_rows_uncorrectable", "remapped_rows_correctable", "pcie_replay"):
            if name in v and name in last and v[name] < last[name]:
                resets += 1
                tracks = {k: t for k, t in tracks.items() if name not in TREND_TARGETS[k][0]}
                short.pop(name, None)
                last.pop(name, None)

        # -- hard failures ---------------------------------------------------------------------
        if g.lost:
            trip("gpu_lost", "migrate", "gpu_lost", f"GPU {g.index} is lost (fell off the bus)")
        if g.hung:
            if sustained("nvml_hung", True):
                trip("nvml_hung", "migrate", "nvml_hung",
                     f"NVML calls on GPU {g.index} hung for {cfg.debounce_samples} polls")
            else:
                failing.add("nvml_hung")
        else:
            streaks["nvml_hung"] = 0
        for ev in xids:
            action = self.xid_action.get(ev.xid)
            if action == "ignore":
                continue
            if ev.xid in XID_APPLICATION and action is None:
                times = tuple(t for t in st.app_xids if now - t < 3600.0) + (now,)
                st = dataclasses.replace(st, app_xids=times)
                if len(times) > cfg.app_xid_max_per_hour:
                    trip("app_xid_rate", "migrate", f"app_xid_rate:{ev.xid}",
                         f"application Xid {ev.xid} repeated {len(times)} times in an hour (limit {cfg.app_xid_max_per_hour})",
                         {"xid": ev.xid, "per_hour": len(times)})
                else:
                    trip("xid", "alert", f"xid:{ev.xid}:{now}", f"application Xid {ev.xid} on GPU {g.index}", {"xid": ev.xid})
                continue
            trip("xid", action or "alert", f"xid:{ev.xid}", f"Xid {ev.xid} on GPU {g.index} ({ev.source})",
                 {"xid": ev.xid})

        def new_increase(name: str) -> float:
            if name not in v or name not in last:
                return 0.0
            return max(0.0, v[name] - last[name])

        if new_increase("ecc_uncorrected_volatile") > 0:
            trip("ecc_uncorrected", "migrate", "ecc_uncorrected",
                 f"{new_increase('ecc_uncorrected_volatile'):g} new uncorrectable ECC error(s)",
                 {"ecc_uncorrected_volatile": v["ecc_uncorrected_volatile"]})
        dbe_times = tuple(t for t in st.dbe_increase_times if now - t < WEEK)
        if new_increase("retired_pages_dbe") > 0:
            dbe_times += (now,)
        if "retired_pages_sbe" in v and "retired_pages_dbe" in v:
            total = v["retired_pages_sbe"] + v["retired_pages_dbe"]
            if total >= cfg.retired_pages_limit:
                trip("retired_pages", "migrate", "retired_pages",
                     f"{total:g} retired pages >= limit {cfg.retired_pages_limit}", {"retired_pages": total})
        if v.get("retired_pages_dbe", 0) > cfg.retired_dbe_limit and dbe_times:
            trip("retired_dbe", "migrate", "retired_dbe",
                 f"{v['retired_pages_dbe']:g} double-bit retired pages > {cfg.retired_dbe_limit} with a new one this week",
                 {"retired_pages_dbe": v["retired_pages_dbe"]})
        if v.get("retired_pages_pending", 0) > 0:
            trip("retired_pending", "alert", "retired_pending", "a page retirement is pending a GPU reset")
        if v.get("remapped_rows_failure", 0) > 0:
            trip("remap_failure", "migrate", "remap_failure", "row remapping failed")
        if v.get("remapped_rows_pending", 0) > 0:
            trip("remap_pending", "migrate", "remap_pending", "a row remap is pending a GPU reset")
        if v.get("remapped_rows_uncorrectable", 0) >= cfg.remap_uncorrectable_limit:
            trip("remap_uncorrectable", "migrate", "remap_uncorrectable",
                 f"{v['remapped_rows_uncorrectable']:g} uncorrectable remaps >= {cfg.remap_uncorrectable_limit}",
                 {"remapped_rows_uncorrectable": v["remapped_rows_uncorrectable"]})
        if v.get("remap_histogram_none", 0) > 0:
            trip("remap_availability", "migrate", "remap_availability:none",
                 f"{v['remap_histogram_none']:g} memory bank(s) have no remap rows left", {"banks_none": v["remap_histogram_none"]})
        elif v.get("remap_histogram_low", 0) > 0:
            trip("remap_availability", "snapshot", "remap_availability:low",
                 f"{v['remap_histogram_low']:g} memory bank(s) are low on remap rows", {"banks_low": v["remap_histogram_low"]})

        # -- rates over the last minute ------------------------------------------------------
        def window_rate(name: str, value: float | None, span: float = 60.0) -> float | None:
            if value is None:
                return None
            hist = tuple(p for p in short.get(name, ()) if now - p[0] <= span) + ((now, value),)
            short[name] = hist[-128:]
            if len(hist) < 2 or hist[-1][0] - hist[0][0] <= 0:
                return None
            return (hist[-1][1] - hist[0][1]) / (hist[-1][0] - hist[0][0])

        replay_rate = window_rate("pcie_replay", v.get("pcie_replay"))
        if replay_rate is not None and "pcie_link_gen" in v and "pcie_link_width" in v:
            gts = PCIE_GTS.get(int(v["pcie_link_gen"]), 32.0)
            limit_per_min = cfg.pcie_replay_ber * gts * 1e9 * v["pcie_link_width"] * 60.0
            per_min = replay_rate * 60.0
            if sustained("pcie_replay_rate", per_min > limit_per_min):
                trip("pcie_replay_rate", "snapshot", "pcie_replay_rate",
                     f"PCIe replays {per_min:.1f}/min > {limit_per_min:.1f}/min", {"per_minute": per_min, "limit": limit_per_min})
        if g.nvlink:
            crc = float(sum(val for (_, kind), val in g.nvlink.items() if kind.startswith("crc")))
            hist = short.get("nvlink_crc", ())
            short["nvlink_crc"] = (hist + ((now, crc),))[-2:]
            rate = None
            if hist and now > hist[-1][0] and crc >= hist[-1][1]:
                rate = (crc - hist[-1][1]) / (now - hist[-1][0])
            if sustained("nvlink_crc_rate", rate is not None and rate >= cfg.nvlink_crc_per_second_limit):
                trip("nvlink_crc_rate", "migrate", "nvlink_crc_rate",
                     f"NVLink CRC errors {rate:.0f}/s >= {cfg.nvlink_crc_per_second_limit:g}/s for {cfg.debounce_samples} polls",
                     {"per_second": rate or 0.0})
        if "temperature_celsius" in v and "slowdown_temperature_celsius" in v:
            hot = v["temperature_celsius"] >= v["slowdown_temperature_celsius"]
            if sustained("thermal", hot):
                trip("thermal", "snapshot", "thermal",
                     f"{v['temperature_celsius']:g} C >= slowdown {v['slowdown_temperature_celsius']:g} C for {cfg.debounce_samples} polls",
                     {"temperature_celsius": v["temperature_celsius"]})
            elif hot:
                trip("thermal", "alert", "thermal:hot", f"{v['temperature_celsius']:g} C >= slowdown threshold",
                     {"temperature_celsius": v["temperature_celsius"]})

        # -- trend prediction ----------------------------------------------------------------
        best_forecast: float | None = None
        if "trend" in active:
            for target, (fields, limit_attr, offset) in TREND_TARGETS.items():
                if any(f not in v for f in fields):
                    continue  # unsupported or failed this poll: no evidence either way
                value = sum(v[f] for f in fields)
                limit = getattr(cfg, limit_attr) + offset
                track = self._track(tracks.get(target, Track()), now, value)
                forecast = self._forecast(track, now, value, limit)
                below = forecast is not None and forecast < cfg.lead_time_seconds and value < limit
                track = dataclasses.replace(track, below_lead=track.below_lead + 1 if below else 0)
                tracks[target] = track
                if forecast is not None and (best_forecast is None or forecast < best_forecast):
                    best_forecast = forecast
                if below and track.below_lead >= cfg.debounce_samples:
                    trip("trend", "migrate", f"trend:{target}",
                         f"{target} forecast to reach {limit:g} in {forecast:.0f} s (< lead time {cfg.lead_time_seconds:g} s)",
                         {target: value, "rate_per_hour": self._rate(track) * 3600, "limit": limit}, forecast)
                elif forecast is not None and forecast < 2 * cfg.lead_time_seconds:
                    failing.add(f"trend:{target}:watch")

        for name in ("ecc_uncorrected_volatile", "retired_pages_dbe", "pcie_replay", "ecc_corrected_volatile",
                     "retired_pages_sbe", "remapped_rows_uncorrectable", "remapped_rows_correctable"):
            if name in v:
                last[name] = v[name]

        # -- cooldown, health ----------------------------------------------------------------
        emitted: list[Trip] = []
        for t in candidates:
            if cooldown.get(t.cause, -math.inf) > now:
                continue
            cooldown[t.cause] = now + cfg.cooldown_seconds
            emitted.append(t)
        health = st.health
        if any(t.action == "migrate" and t.rule != "trend" for t in candidates):
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
            tracks=MappingProxyType(tracks),
            short=MappingProxyType(short),
            streaks=MappingProxyType(streaks),
            clean_polls=clean,
            cooldown_until=MappingProxyType(cooldown),
            app_xids=st.app_xids,
            dbe_increase_times=dbe_times,
            forecast_seconds=best_forecast,
            resets=resets,
        )
        return new, emitted

    def _track(self, track: Track, now: float, value: float) -> Track:
        window = self.cfg.trend_window_seconds
        bucket = window / TREND_POINTS
        points = tuple(p for p in track.points if now - p[0] <= window)
        increases = tuple(t for t in track.increases if now - t <= window)
        if points and value > points[-1][1]:
            increases += (now,)
        if points and len(points) >= 2 and now - points[-2][0] < bucket:
            points = points[:-1] + ((now, value),)  # keep the last sample of each bucket
        else:
            points += ((now, value),)
        return Track(points[-TREND_POINTS:], increases[-TREND_POINTS:], track.below_lead)

    def _rate(self, track: Track) -> float:
        return theil_sen(track.points)

    def _forecast(self, track: Track, now: float, value: float, limit: float) -> float | None:
        """Seconds until ``value`` reaches ``limit`` at the robust rate; None without evidence."""
        if value >= limit:
            return 0.0
        if len(track.increases) < MIN_INCREASES:
            return None  # one burst is not a trend
        rate = self._rate(track)
        if rate <= 0:
            return None
        return (limit - value) / rate
