"""Every rank of one host stops (SIGSTOP), as when a GPU hang takes all of its node's ranks with
it: the node's agent and daemon live, but no rank of the node can report. The hand-over must
come within 60 s of the last completed step, with at most one recomputed step (the hang
fault's verdict)."""

from __future__ import annotations

import os
import signal

from sentinel_tools.faults.hang import FAULT as HANG
from sentinel_tools.faults.hang import verdict as hang_verdict
from sentinel_tools.faults.base import Fault


def inject(drill, victim) -> None:
    for pid in drill._ranks_of(victim):
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass


FAULT = Fault("hang-host", "every rank of one host SIGSTOPped at once (a GPU hang that takes the whole node)",
              inject, verdict=hang_verdict, pg_timeout_seconds=HANG.pg_timeout_seconds)
