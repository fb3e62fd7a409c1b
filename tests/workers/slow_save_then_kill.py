"""Reference job whose snapshot at --kill-at-step writes slowly, and whose rank 1 is killed with
SIGKILL while that asynchronous save is still being written."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed.checkpoint.filesystem as fs

import trainer.guard as guard_mod
from trainer import train

KILL_AT = int(os.environ["KILL_AT_STEP"])
_write = fs.FileSystemWriter.write_data


def slow_write(self, plan, planner):
    if f"{guard_mod.PREFIX}{KILL_AT:09d}" in str(self.path):
        time.sleep(3.0)
    return _write(self, plan, planner)


fs.FileSystemWriter.write_data = slow_write
_step = guard_mod.SnapshotGuard.step


def step(self, n):
    _step(self, n)
    if n == KILL_AT and self.rank == 1:
        assert self._inflight is not None and not self._inflight.write.done(), "save must still be in flight"
        os.kill(os.getpid(), signal.SIGKILL)


guard_mod.SnapshotGuard.step = step
sys.exit(train.main())
