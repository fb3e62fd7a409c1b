"""A sudden node failure: kill -9 of the node's agent and workers, no warning, its memory gone.
The daemon has nothing to migrate; the scheduler (the drill) gives the job a spare."""

from __future__ import annotations

import os
import signal
import subprocess

from sentinel_tools.faults.base import Fault
from sentinel_tools.harness import descendants


def inject(drill, victim) -> None:
    if victim.agent is None:
        return
    for pid in [victim.agent.pid, *descendants(victim.agent.pid)]:  # agent and workers, no warning
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    drill.forget_memory(victim)  # the node's memory died with it


def replace(drill, victims, deadline: float) -> None:
    """The nodes died with their daemons' help unavailable: the scheduler replaces them."""
    for v in victims:
        subprocess.run(drill.claim_argv(v.name), env=drill.env, check=False, timeout=30, capture_output=True)


def verdict(drill, result, outcome) -> bool:
    """At most one recomputed step from the memory tier (the disk interval without it)."""
    return outcome.base_ok and len(outcome.lost) <= outcome.bound


FAULT = Fault("kill", "sudden failure: kill -9 of the node's agent and workers, no warning", inject,
              verdict=verdict, follow_up=replace, sudden=True, rdzv_default="sentinel",
              rdzv_default_why="the slot rendezvous tells the dead node from the survivors' own connection errors "
                               "and a refused probe of its agent (#48): c10d waits for its keep-alive to expire")
