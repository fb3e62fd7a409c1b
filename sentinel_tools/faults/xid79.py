"""Xid 79: the GPU fell off the bus. Predicted (the daemon sees it): nothing may be lost."""

from __future__ import annotations

from sentinel.sources import simulated
from sentinel_tools.faults.base import Fault


def inject(drill, victim) -> None:
    simulated.inject(victim.gpus, 0, ["xid=79"])


FAULT = Fault("xid79", "Xid 79 (GPU fell off the bus) on one GPU", inject)
