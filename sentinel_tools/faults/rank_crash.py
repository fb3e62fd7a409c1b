"""kill -9 of one training rank while its agent lives: the workers restart in place, the spare
stays cold, and the state comes from the node's own memory."""

from __future__ import annotations

import os
import signal

from sentinel_tools.faults.base import Fault


def inject(drill, victim) -> None:
    # a rank of this node, by the pid it logged: argv cannot tell a rank from its agent (a warm
    # agent's and its forkserver's argv name the training module too)
    if victim.agent is None:
        return
    ranks = drill._ranks_of(victim)
    if ranks:
        os.kill(ranks[0], signal.SIGKILL)


def verdict(drill, result, outcome) -> bool:
    """No migration: the same nodes carry on, restored from the node's own memory (no disk, no peer)."""
    result["spare_in_place"] = False
    ok = result["finished"] and outcome.victim.name in outcome.final_nodes and len(outcome.lost) <= outcome.bound
    if drill.args.memory_interval_steps > 0:
        ok = ok and result["restore"]["tier"] == "memory" and not result["restore"]["peer"]
    return ok


FAULT = Fault("rank-crash", "kill -9 of one training rank, agent alive (the spare stays cold; workers restart in place)",
              inject, verdict=verdict, replaces_node=False, rdzv_default="sentinel",
              rdzv_default_why="the slot rendezvous's re-rendezvous of the same nodes is one generation (10-20 ms "
                               "here, c10d's round 0.5 s), and the survivors' connection errors probe the crashed "
                               "rank's node, find its agent alive and declare nothing (#48)")
