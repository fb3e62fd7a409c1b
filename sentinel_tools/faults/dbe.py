"""A double-bit ECC error: the daemon trips at once; nothing may be lost."""

from __future__ import annotations

from sentinel.sources import simulated
from sentinel_tools.faults.base import Fault


def inject(drill, victim) -> None:
    simulated.inject(victim.gpus, 0, ["ecc-dbe=+1"])


FAULT = Fault("dbe", "a double-bit (uncorrectable) ECC error", inject)
