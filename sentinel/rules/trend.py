"""``trend``: forecast the time until a counter reaches its limit, and act before it does.

Targets: retired pages → ``retired_pages_limit`` (63), DBE-retired pages → ``retired_dbe_limit`` + 1
(16), uncorrectable remaps → ``remap_uncorrectable_limit`` (512). For each, a decimated history (at
most ``TREND_POINTS`` points over ``trend_window_seconds``, the last sample of each bucket) feeds a
Theil–Sen slope — the median of all pairwise slopes, which tolerates up to 29 % outliers, so a
burst does not look like a trend. A forecast needs ``MIN_INCREASES`` distinct increases inside the
window: one jump is never a trend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from sentinel import settings
from sentinel.rules.base import DEBOUNCE_SAMPLES, LEAD_TIME_SECONDS, ConfigKey, Finding, GpuRule
from sentinel.rules.remap_uncorrectable import REMAP_UNCORRECTABLE_LIMIT
from sentinel.rules.retired_dbe import RETIRED_DBE_LIMIT
from sentinel.rules.retired_pages import RETIRED_PAGES_LIMIT

# Trend targets: name -> (fields summed, threshold attribute of PolicyConfig, offset)
TREND_TARGETS: Mapping[str, tuple[tuple[str, ...], str, int]] = MappingProxyType({
    "retired_pages": (("retired_pages_sbe", "retired_pages_dbe"), "retired_pages_limit", 0),
    "retired_dbe": (("retired_pages_dbe",), "retired_dbe_limit", 1),
    "remapped_rows": (("remapped_rows_uncorrectable",), "remap_uncorrectable_limit", 0),
})
TREND_POINTS = 64  # decimated history per counter
MIN_INCREASES = 3  # distinct increases in the window before a trend can forecast

TREND_WINDOW_SECONDS = ConfigKey(
    "trend_window_seconds", 3600.0, "Sentinel: an hour of history, 64 points, for the Theil-Sen slope",
    0, 30 * settings.DAY, low_open=True)


@dataclass(frozen=True)
class Track:
    """A monotonic counter's decimated history (for Theil–Sen) and its recent increases."""

    points: tuple[tuple[float, float], ...] = ()
    increases: tuple[float, ...] = ()
    below_lead: int = 0


EMPTY = Track()


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


def advance(track: Track, now: float, value: float, window: float) -> Track:
    """``track`` with the sample ``(now, value)`` added and what fell out of ``window`` dropped."""
    bucket = window / TREND_POINTS
    points, increases = track.points, track.increases
    while points and now - points[0][0] > window:  # in time order: only the oldest leave the window
        points = points[1:]
    while increases and now - increases[0] > window:
        increases = increases[1:]
    if points and value > points[-1][1]:
        increases += (now,)
    if points and len(points) >= 2 and now - points[-2][0] < bucket:
        points = points[:-1] + ((now, value),)  # keep the last sample of each bucket
    else:
        points += ((now, value),)
    return Track(points[-TREND_POINTS:], increases[-TREND_POINTS:], track.below_lead)


def forecast(track: Track, value: float, limit: float) -> float | None:
    """Seconds until ``value`` reaches ``limit`` at the robust rate; None without evidence."""
    if value >= limit:
        return 0.0
    if len(track.increases) < MIN_INCREASES:
        return None  # one burst is not a trend
    rate = theil_sen(track.points)
    if rate <= 0:
        return None
    return (limit - value) / rate


class Trend(GpuRule):
    """A target's forecast time to its limit stays under ``lead_time_seconds`` (600) for
    ``debounce_samples`` (3) polls → ``migrate`` (PREDICTED_FAILURE, not FAILED); a forecast under
    2 × lead time puts the GPU in WATCH. A target whose fields did not read this poll is not
    updated (no evidence either way); a counter reset drops its history. An inactive trend keeps no
    history and reports no forecast.

    Source: Sentinel (Theil–Sen over the last ``trend_window_seconds``); the limits are the
    ``retired_pages``, ``retired_dbe`` and ``remap_uncorrectable`` rules' own."""

    name = "trend"
    counters = ("retired_pages_sbe", "retired_pages_dbe", "remapped_rows_uncorrectable")
    config = (LEAD_TIME_SECONDS, DEBOUNCE_SAMPLES, TREND_WINDOW_SECONDS, RETIRED_PAGES_LIMIT, RETIRED_DBE_LIMIT,
              REMAP_UNCORRECTABLE_LIMIT)
    order = 500
    predicts = True

    def evaluate(self, ctx, cfg):
        if self.name not in ctx.active:
            return ()
        v, now, lead = ctx.values, ctx.now, cfg.lead_time_seconds
        found = []
        for target, (fields, limit_attr, offset) in TREND_TARGETS.items():
            if any(f not in v for f in fields):
                continue  # unsupported or failed this poll: no evidence either way
            value = sum(v[f] for f in fields)
            limit = getattr(cfg, limit_attr) + offset
            track = advance(ctx.tracks.get(target, EMPTY), now, value, cfg.trend_window_seconds)
            seconds = forecast(track, value, limit)
            below = seconds is not None and seconds < lead and value < limit
            if below or track.below_lead:  # the count of polls below the lead time changes
                track = Track(track.points, track.increases, track.below_lead + 1 if below else 0)
            ctx.tracks[target] = track
            ctx.forecast(seconds)
            if below and track.below_lead >= cfg.debounce_samples:
                found.append(Finding(
                    "migrate", f"trend:{target}",
                    f"{target} forecast to reach {limit:g} in {seconds:.0f} s (< lead time {lead:g} s)",
                    {target: value, "rate_per_hour": theil_sen(track.points) * 3600, "limit": limit}, seconds, lead))
            elif seconds is not None and seconds < 2 * lead:
                ctx.watch(f"trend:{target}:watch")
        return found


RULE = Trend()
