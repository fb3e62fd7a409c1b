"""A hung collective: one rank SIGSTOPped (--hang-mode stop) or never entering the collective
(skip). The hang watch must name it and hand over within 60 s of the last completed step."""

from __future__ import annotations

import os
import signal

from sentinel_tools.faults.base import Fault, step_health

HANDOVER_BOUND_SECONDS = 60


def inject(drill, victim) -> None:
    if victim.agent is None:
        return
    if drill.args.hang_mode == "skip":
        (victim.runtime / "drill-fault").write_text("skip")
    else:
        ranks = drill._ranks_of(victim)
        if ranks:
            os.kill(ranks[0], signal.SIGSTOP)


def verdict(drill, result, outcome) -> bool:
    mig = outcome.migration
    tripped = mig.get("times", {}).get("tripped")
    steps, health = step_health(outcome.events, mig, outcome.t_fault, outcome.t_first)
    last = max((t for t, _ in steps if t < (tripped or float("inf"))), default=None)
    handover = round(tripped - last, 3) if tripped and last else None
    health["last_completed_step_to_handover_seconds"] = handover
    health["ok"] = mig.get("rule") == "hang" and handover is not None and handover <= HANDOVER_BOUND_SECONDS
    result["job_health"] = health
    return outcome.base_ok and len(outcome.lost) <= 1 and health["ok"]


FAULT = Fault("hang", "a hung collective: one rank SIGSTOPped (--hang-mode stop) or never entering the collective (skip)",
              inject, verdict=verdict, pg_timeout_seconds=300)  # the hang watch (T >= 30 s), not the pg timeout
