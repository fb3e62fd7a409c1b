"""The shape of a drill fault and what its verdict reads (:mod:`sentinel_tools.faults`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from sentinel_tools.drill_cluster import Drill, Node


@dataclass
class Outcome:
    """What the report measured, for a fault's verdict."""

    events: list[dict[str, Any]]
    migration: dict[str, Any]  # the victim's migration record
    victim: "Node"
    t_fault: float
    t_first: float | None  # the first step after the snapshot was loaded
    lost: list[int]  # steps run more than once
    bound: int  # recomputed steps the memory tier (or the disk interval) allows a sudden loss
    final_nodes: list[str]
    base_ok: bool  # finished with a spare in place of the victim


def no_follow_up(drill: "Drill", victims: list["Node"], deadline: float) -> None:
    return None


def nothing_lost(drill: "Drill", result: dict[str, Any], outcome: Outcome) -> bool:
    """A predicted failure: the spare is in place and no step is run twice."""
    return outcome.base_ok and not outcome.lost


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    inject: Callable[["Drill", "Node"], None]
    verdict: Callable[["Drill", dict[str, Any], Outcome], bool] = nothing_lost
    follow_up: Callable[["Drill", list["Node"], float], None] = no_follow_up
    replaces_node: bool = True  # False: the same nodes carry on (no spare, no migration)
    sudden: bool = False  # True: the node dies with its daemon, no migration record
    pg_timeout_seconds: int = 30  # the workers' process-group timeout
    needs_hosts: bool = False  # True: a fault of a whole host, only on --hosts netns
    rdzv_backend: str = ""  # the rendezvous backend the fault needs ("": any; the drill's default c10d)
    rdzv_why: str = ""  # why, said when another one is asked for
    rdzv_default: str = ""  # the backend used when none is asked for (--agent warm), others allowed ("": c10d)
    rdzv_default_why: str = ""  # why that one (the drill's --help, docs/drill.md)
    min_nodes: int = 0  # the fewest nodes the fault's drill can judge (the default --nodes when above 2)
    min_nodes_why: str = ""
