"""The host that runs the rendezvous store powers off (--hosts netns). Training goes on as long as
no membership change needs the store, so one of node1's ranks then crashes (as ranks do), and the
job must take a new membership: with a single c10d TCPStore it cannot. The drill must say so in
one clear line within STORE_LOSS_BOUND_SECONDS of the fault, and must not hang (a replicated
store is #42); the daemons of the nodes whose agents said it show it in ``sentinel status``
(``job.rendezvous``) and /metrics (``sentinel_job_rendezvous_store_up 0``)."""

from __future__ import annotations

import time

from sentinel_tools.faults import rank_crash
from sentinel_tools.faults.base import Fault

STORE_LOSS_BOUND_SECONDS = 30.0
CRASH_AFTER_SECONDS = 1.0  # the store's host is gone first; then a rank needs the job to restart


def inject(drill, victim) -> None:
    drill.power_off_store()


def crash_a_rank(drill, victims, deadline: float) -> None:
    time.sleep(CRASH_AFTER_SECONDS)
    for v in victims:
        rank_crash.inject(drill, v)


def verdict(drill, result, outcome) -> bool:
    """One clear line in time, and the daemon of a node whose agent said it shows it."""
    said = result.get("store_lost") or {}
    result["spare_in_place"] = False
    return (not result["finished"] and bool(said.get("line"))
            and said.get("seconds_after_fault", float("inf")) <= STORE_LOSS_BOUND_SECONDS
            and bool(said.get("daemons_saying_so")))


FAULT = Fault("store-host", "the rendezvous store's host powers off, then a rank crashes (--hosts netns): the job "
              "cannot restart without its store and must say so within 30 s", inject, verdict=verdict,
              follow_up=crash_a_rank, replaces_node=False, needs_hosts=True)
