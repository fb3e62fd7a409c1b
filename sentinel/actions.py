"""Carries the policy's trips out. Never re-reads hardware; a failed action is logged, counted,
and the daemon loop goes on.

* ``alert``    — the structured log line and metrics are the alert (Prometheus rules page on them).
* ``snapshot`` — send ``snapshot`` to the node's trainer ranks over the control channel.
* ``migrate``  — send ``migrate``; once the ranks acknowledge (or the ack times out), cordon the
  node and stop its torchrun agent (see :mod:`sentinel.migration`).
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from typing import Callable, Protocol

from sentinel.families import counter
from sentinel.log import event
from sentinel.policy import ACTION_RANK, Trip

log = logging.getLogger("sentinel.actions")


class TrainerLink(Protocol):
    def request(self, kind: str, request_id: str, reason: str) -> int: ...


class Migrator(Protocol):
    def begin(self, request_id: str, trip: Trip) -> None: ...


ACTIONS = counter("sentinel_actions", "Actions carried out, by kind and outcome", "action", "outcome")


class Executor:
    def __init__(self, trainer: TrainerLink | None = None, migrator: Migrator | None = None,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:12]) -> None:
        self.trainer = trainer
        self.migrator = migrator
        self.new_id = new_id
        self.counts: Counter[tuple[str, str]] = Counter()  # (kind, outcome)

    def execute(self, trips: list[Trip]) -> None:
        if not trips:
            return
        for t in trips:
            event(log, "policy trip", logging.WARNING if t.action != "alert" else logging.INFO, **t.as_log())
        strongest = max(trips, key=lambda t: ACTION_RANK[t.action])
        kind = strongest.action
        if kind == "alert":
            self.counts[("alert", "ok")] += 1
            return
        reason = f"{strongest.rule}: {strongest.message} ({strongest.where})"
        request_id = self.new_id()
        try:
            if kind == "migrate" and self.migrator is not None:
                self.migrator.begin(request_id, strongest)  # idempotent: one migration per node
                self.counts[("migrate", "requested")] += 1
            elif self.trainer is not None:
                reached = self.trainer.request(kind, request_id, reason)
                self.counts[(kind, "sent" if reached else "no_trainer")] += 1
            else:
                self.counts[(kind, "no_trainer")] += 1
        except OSError as exc:
            self.counts[(kind, "error")] += 1
            event(log, "action failed", logging.ERROR, action=kind, request_id=request_id, error=str(exc))
