"""Scenario corpus replay: timelines of counter values and events fed through the policy with an
injected clock. Used by tests/test_scenarios.py and bench/predict_eval.py.

A scenario (``tests/scenarios/*.toml``) has:

* ``name``, ``kind`` (``degrading``: must be predicted with lead time; ``sudden``: must be
  caught when it happens; ``benign``: must never migrate), ``poll_seconds``,
  ``duration_seconds``, ``seed``, ``failure_at`` (when the hardware really fails; degrading and
  sudden only).
* ``[values]``: initial field values over a healthy GPU's.
* ``[[ramp]]``: ``field``, ``start``, ``end``, ``per_hour`` (optionally ``per_hour_end`` for a
  linear acceleration), ``jitter`` (0..1, seeded multiplicative noise on each increment).
* ``[[burst]]``: ``field``, ``start``, ``every``, ``add``, ``until``.
* ``[[set]]``: ``at``, ``field``, ``value`` (a reset is a set to a lower value).
* ``[[xid]]``: ``at``, ``xid``, ``count``.
* ``[[hung]]``/``[[lost]]``: ``start``, ``end``.
* ``[[kernel]]``: ``at``, ``kind`` (``rank_signal``, ``mc_error``, ``aer``, ``kernel_log``), optional ``gpu``, and a
  ``[kernel.detail]`` table (what the kernel source would report, e.g. ``signal``/``code``).
* ``[[expect]]``: ``rule``, ``action``, ``at`` — the exact trips, in order.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sentinel.config import PolicyConfig
from sentinel.policy import Policy, PolicyState, Trip
from sentinel.readings import GpuReading, KernelEvent, NodeReadings, XidEvent

HEALTHY = {
    "ecc_corrected_volatile": 0, "ecc_uncorrected_volatile": 0, "ecc_corrected_aggregate": 0,
    "ecc_uncorrected_aggregate": 0, "retired_pages_sbe": 0, "retired_pages_dbe": 0, "retired_pages_pending": 0,
    "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0, "remapped_rows_pending": 0,
    "remapped_rows_failure": 0, "remap_histogram_max": 640, "remap_histogram_high": 0, "remap_histogram_partial": 0,
    "remap_histogram_low": 0, "remap_histogram_none": 0, "pcie_replay": 0, "pcie_link_gen": 5, "pcie_link_width": 16,
    "temperature_celsius": 45, "slowdown_temperature_celsius": 87, "power_watts": 400.0, "throttle_reasons": 0,
    "nvlink_crc": 0, "recovery_action": 0,
}


@dataclass(frozen=True)
class Result:
    name: str
    kind: str
    failure_at: float | None
    trips: list[tuple[float, Trip]]

    @property
    def first_migrate(self) -> float | None:
        return next((t for t, trip in self.trips if trip.action == "migrate"), None)

    @property
    def lead_seconds(self) -> float | None:
        if self.failure_at is None or self.first_migrate is None:
            return None
        return self.failure_at - self.first_migrate


def load(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def replay(scenario: dict[str, Any], config: PolicyConfig | None = None) -> Result:
    cfg = config or PolicyConfig()
    policy = Policy(cfg)
    rng = random.Random(scenario.get("seed", 0))
    step = float(scenario["poll_seconds"])
    duration = float(scenario["duration_seconds"])
    values = {**HEALTHY, **scenario.get("values", {})}
    acc = {k: float(v) for k, v in values.items()}  # fractional accumulators for ramps
    state = PolicyState()
    trips: list[tuple[float, Trip]] = []
    n = int(duration // step) + 1
    for i in range(n):
        t = i * step
        for ramp in scenario.get("ramp", []):
            if ramp["start"] < t <= ramp["end"]:
                frac = (t - ramp["start"]) / max(1e-9, ramp["end"] - ramp["start"])
                per_hour = ramp["per_hour"] + (ramp.get("per_hour_end", ramp["per_hour"]) - ramp["per_hour"]) * frac
                inc = per_hour / 3600.0 * step * (1 + ramp.get("jitter", 0.0) * rng.uniform(-1, 1))
                acc[ramp["field"]] += max(0.0, inc)
        for burst in scenario.get("burst", []):
            if t >= burst["start"] and t <= burst.get("until", math.inf) and (t - burst["start"]) % burst["every"] < step:
                acc[burst["field"]] += burst["add"]
        for s in scenario.get("set", []):
            if s["at"] == t:
                acc[s["field"]] = float(s["value"])
        hung = any(h["start"] <= t < h["end"] for h in scenario.get("hung", []))
        lost = any(h["start"] <= t < h["end"] for h in scenario.get("lost", []))
        shown = {k: float(math.floor(v)) for k, v in acc.items() if k != "nvlink_crc"}
        if scenario.get("noise", False):
            shown["temperature_celsius"] = float(values["temperature_celsius"] + rng.randint(-8, 20))
            shown["power_watts"] = values["power_watts"] + rng.uniform(-50, 50)
        events = tuple(
            XidEvent(gpu=0, xid=x["xid"], source="scenario")
            for x in scenario.get("xid", [])
            if x["at"] == t
            for _ in range(x.get("count", 1))
        )
        gpu = GpuReading(
            index=0,
            uuid="GPU-scenario",
            pci_bus_id="0000:18:00.0",
            values={} if hung or lost else shown,
            nvlink={} if hung or lost else {(0, "crc_flit"): int(acc["nvlink_crc"])},
            lost=lost,
            hung=hung,
        )
        kernel = tuple(KernelEvent(kind=k["kind"], source="scenario", detail=dict(k.get("detail", {})), gpu=k.get("gpu"))
                       for k in scenario.get("kernel", []) if float(k["at"]) == t)
        readings = NodeReadings(time=t, driver_version="scenario", gpus=(gpu,), xid_events=events, kernel_events=kernel)
        state, new = policy.decide(state, readings, t)
        trips.extend((t, trip) for trip in new)
    return Result(scenario["name"], scenario["kind"], scenario.get("failure_at"), trips)


def corpus(directory: str | Path) -> list[dict[str, Any]]:
    return [load(p) for p in sorted(Path(directory).glob("*.toml"))]


def config_for(scenario: dict[str, Any]) -> PolicyConfig:
    overrides = scenario.get("policy", {})
    return dataclasses.replace(PolicyConfig(), **overrides)
