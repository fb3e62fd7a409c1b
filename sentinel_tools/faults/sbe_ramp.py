"""Single-bit errors retiring pages at a rate only the trend predictor catches: a jump of 40,
then one more page every 0.3 s until the node is cordoned (or 30 s pass)."""

from __future__ import annotations

import time

from sentinel.sources import simulated
from sentinel_tools.faults.base import Fault

RAMP_SECONDS = 30.0


def inject(drill, victim) -> None:
    simulated.inject(victim.gpus, 0, ["retired-sbe=+40"])


def ramp(drill, victims, deadline: float) -> None:
    """One more page retired every 0.3 s on the first victim — a trend, not a jump."""
    victim = victims[0]
    until = min(deadline, time.time() + RAMP_SECONDS)
    while time.time() < until and not (victim.state_dir / "cordon.json").exists():
        simulated.inject(victim.gpus, 0, ["retired-sbe=+1"])
        time.sleep(0.3)


FAULT = Fault("sbe-ramp", "single-bit errors retiring pages at a rate only the trend predictor catches", inject,
              follow_up=ramp)
