"""Replay every scenario through the policy with an injected clock; assert the exact trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from sentinel import rules
from sentinel_tools import scenarios

CORPUS = Path(__file__).parent / "scenarios"
FILES = sorted(CORPUS.glob("*.toml"))
LEAD_TARGET = 300.0  # every degrading scenario predicted with >= 5 minutes lead


def replay(sc, monkeypatch=None):
    return scenarios.replay(sc, scenarios.config_for(sc))


def test_corpus_covers_the_required_timelines():
    names = {p.stem for p in FILES}
    assert {"healthy_week", "sbe_storm_to_dbe", "remap_to_failure", "sudden_xid79", "app_xid13_bursts",
            "pcie_replay_bursts", "nvlink_crc_ramp", "driver_reload", "thermal_excursion"} <= names


def test_every_rule_has_a_scenario_that_trips_it():
    """A new rule comes with a scenario; test_exact_trips_and_timing checks the expectations are real."""
    tripped = {e["rule"] for path in FILES for e in scenarios.load(path)["expect"]}
    assert sorted(rules.RULE_NAMES - tripped) == []


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_exact_trips_and_timing(path, monkeypatch):
    sc = scenarios.load(path)
    result = replay(sc, monkeypatch)
    got = [(trip.rule, trip.action, t) for t, trip in result.trips]
    want = [(e["rule"], e["action"], float(e["at"])) for e in sc["expect"]]
    assert got == want
    if sc["kind"] == "degrading":
        assert result.lead_seconds is not None and result.lead_seconds >= LEAD_TARGET
        first = next(trip for _, trip in result.trips if trip.action == "migrate")
        if first.rule == "trend":
            assert first.forecast_seconds is not None and first.lead_time_seconds == 600.0
    elif sc["kind"] == "sudden":
        assert result.first_migrate is not None and result.first_migrate <= sc["failure_at"] + 5
    else:
        assert result.first_migrate is None, "benign scenarios never migrate"
