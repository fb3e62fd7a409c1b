"""A hung collective: one rank SIGSTOPped (--hang-mode stop) or never entering the collective
(skip). The hang watch must name it and hand over within 60 s of the last completed step
(:func:`sentinel_tools.drill_verdict.job_health`), with at most one recomputed step."""

from __future__ import annotations

import os
import signal

from sentinel_tools.drill_verdict import job_health
from sentinel_tools.faults.base import Fault


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
    result["job_health"] = job_health("hang", outcome.events, mig.get("times", {}), mig, outcome.t_fault,
                                      outcome.t_first, failed=outcome.victim.name, replacement=result["replacement"])
    return outcome.base_ok and len(outcome.lost) <= 1 and result["job_health"]["ok"]


FAULT = Fault("hang", "a hung collective: one rank SIGSTOPped (--hang-mode stop) or never entering the collective (skip)",
              inject, verdict=verdict, pg_timeout_seconds=300)  # the hang watch (T >= 30 s), not the pg timeout
