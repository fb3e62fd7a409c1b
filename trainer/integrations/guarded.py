"""What every integration does around ``SnapshotGuard.step``: report the snapshots the guard
finished as progress lines (rank 0), and leave at once when the daemon drains this node (the exit
code ``trainer/train.py`` uses, so torchrun restarts the group with the spare)."""

from __future__ import annotations

import os
import sys
from typing import Callable

from trainer.guard import NodeDrained, SnapshotGuard
from trainer.integrations.progress import ProgressRecord

DRAINED_EXIT = 75  # what trainer.train exits with when drained; torchrun restarts the group


def report_snapshots(guard: SnapshotGuard | None, record: ProgressRecord, reported: int) -> int:
    """Rank 0: one ``snapshot`` line per guard record after the first ``reported``; the new count."""
    records = guard.records if guard is not None else []
    for rec in records[reported:]:
        if record.rank == 0:
            record("snapshot", step=rec.step, ok=rec.ok, kind=rec.kind, path=rec.path, error=rec.error[:200])
    return len(records)


def step_or_leave(guard: SnapshotGuard, step: int, record: ProgressRecord, report: Callable[[], None],
                  exit_on_drain: bool) -> None:
    """``guard.step(step)``, then ``report()``. Drained: report, record why, and exit with
    :data:`DRAINED_EXIT` (or re-raise :class:`NodeDrained` when ``exit_on_drain`` is False)."""
    try:
        guard.step(step)
    except NodeDrained as exc:
        report()
        record("drained", step=step, reason=str(exc)[:200])
        if not exit_on_drain:
            raise
        sys.stderr.write(f"sentinel: {exc}\n")
        sys.stderr.flush()
        os._exit(DRAINED_EXIT)
    report()
