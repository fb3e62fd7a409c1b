"""The drill's faults: one module each, with how it is injected and what makes its drill pass.

A fault is a :class:`Fault`. ``inject(drill, victim)`` does the damage to one node;
``follow_up(drill, victims, deadline)`` runs once after every victim was hit (a ramp that goes
on, a scheduler's replacement of a node that died with its daemon); ``verdict(drill, result,
outcome)`` says whether the job got through, from what the drill's report measured, before the
bitwise ``--verify`` (which every fault must pass when it is asked for).
"""

from __future__ import annotations

from sentinel_tools.faults import dbe, hang, hang_host, kill, partition, power_off, rank_crash, sbe_ramp, slow, slow_link, store_host, xid79
from sentinel_tools.faults.base import Fault, Outcome

__all__ = ["FAULTS", "Fault", "Outcome", "get"]

FAULTS: dict[str, Fault] = {f.name: f for f in (xid79.FAULT, dbe.FAULT, sbe_ramp.FAULT, kill.FAULT, rank_crash.FAULT,
                                                hang.FAULT, slow.FAULT, power_off.FAULT,
                                                store_host.FAULT, hang_host.FAULT,
                                                partition.FAULT, slow_link.FAULT, power_off.LEADER_REPLACING)}


def get(name: str) -> Fault:
    return FAULTS[name]
