"""The host that runs the rendezvous store powers off (--hosts netns). With a single c10d
TCPStore the job cannot take a new membership: when it needs one, the drill must say so in one
clear line within STORE_LOSS_BOUND_SECONDS of the fault, must not hang (a replicated store is
#42), and the daemons of the nodes whose agents said it show it in ``sentinel status``
(``job.rendezvous``) and /metrics (``sentinel_job_rendezvous_store_up 0``). The power-off is
silent (no FIN/RST leaves the store's host), and one worker of the victim node crashes
NEED_AFTER_SECONDS later, so that the job needs a new membership: the agents' re-rendezvous meets
a store that answers nothing, which torch's store call does not bound (docs/known-limits.md) and
the agent's own deadline does (``trainer/store_deadline.py``). A job that needs no new
membership before its end (the crash came too late) finishes without its store."""

from __future__ import annotations

import os
import signal
import time

from sentinel_tools.faults.base import Fault
from sentinel_tools.harness import descendants

STORE_LOSS_BOUND_SECONDS = 30.0
NEED_AFTER_SECONDS = 0.5


def inject(drill, victim) -> None:
    drill.power_off_store()
    time.sleep(NEED_AFTER_SECONDS)
    worker = _a_worker(victim.agent.pid) if victim.agent is not None else None
    if worker is not None:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _a_worker(agent: int) -> int | None:
    """A rank of the node: a process with nothing below it, two levels or more below the agent
    (launch -> agent -> forkserver -> ranks), the largest in memory (a rank holds torch and the
    model; a helper process like multiprocessing's resource tracker does not)."""
    below = set(descendants(agent))
    rss: dict[int, int] = {}
    for pid in below:
        try:
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            if parent in below and not descendants(pid):
                rss[pid] = int(open(f"/proc/{pid}/statm").read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return max(rss, key=rss.get) if rss else None


def verdict(drill, result, outcome) -> bool:
    said = result.get("store_lost") or {}
    if result["finished"] and not outcome.lost:
        return True  # the job did not need its store again before it ended
    # one clear line in time, and the daemon of a node whose agent said it shows it in its status
    return (bool(said.get("line")) and said.get("seconds_after_fault", float("inf")) <= STORE_LOSS_BOUND_SECONDS
            and bool(said.get("daemons_saying_so")))


FAULT = Fault("store-host", "the rendezvous store's host powers off (--hosts netns): the job must say it cannot go on, "
              "within 30 s", inject, verdict=verdict, sudden=True, needs_hosts=True)
