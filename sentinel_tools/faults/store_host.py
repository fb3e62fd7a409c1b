"""The host that runs the rendezvous store powers off (--hosts netns). With a single c10d
TCPStore the job cannot continue: the drill must say so in one clear line within
STORE_LOSS_BOUND_SECONDS of the fault, and must not hang (a replicated store is #42)."""

from __future__ import annotations

from sentinel_tools.faults.base import Fault

STORE_LOSS_BOUND_SECONDS = 30.0


def inject(drill, victim) -> None:
    drill.power_off_store()


def verdict(drill, result, outcome) -> bool:
    said = result.get("store_lost") or {}
    if result["finished"] and not outcome.lost:
        return True  # the job did not need its store again before it ended
    return bool(said.get("line")) and said.get("seconds_after_fault", float("inf")) <= STORE_LOSS_BOUND_SECONDS


FAULT = Fault("store-host", "the rendezvous store's host powers off (--hosts netns): the job must say it cannot go on, "
              "within 30 s", inject, verdict=verdict, sudden=True, needs_hosts=True)
