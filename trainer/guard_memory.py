"""The memory tier's part of :class:`trainer.guard.SnapshotGuard`'s per-step hook (a mixin: the guard
coordinates, :mod:`trainer.memory` stores).

One agreement a check step on the control group (an all-reduce MAX, :mod:`trainer.agree`) carries the strongest request any rank holds,
whether any rank's replica copy or disk write still runs, and the least step every rank's replica
round succeeded at. It is issued *before* this step's own copy is taken and waited for after it:
the copy is needed whatever the ranks agree (the state is this step's either way; only whether it
is handed to the replicator, kept for a disk write or left as this rank's own copy depends on the
agreement), so the collective's round trips run behind the copy instead of ahead of it. The copy
goes into a slot that is free before the agreement (never the agreed copy, the disk write's or a
replica round's); when none is, it is taken after the agreement, as before. What the ranks decide,
and at which step, is unchanged: every rank decides from the same agreed vector.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sentinel.channel import Ack, Request
from trainer.agree import MaxAgreement
from trainer.disk import snapshot_path
from trainer.memory.plan import nodes_left_without_a_copy

log = logging.getLogger("sentinel.trainer")

NONE, SNAPSHOT, MIGRATE = 0, 1, 2


@dataclass
class SnapshotRecord:
    step: int
    path: str
    blocked_seconds: float
    total_seconds: float
    kind: str
    ok: bool
    error: str = ""
    bytes: int = 0
    request_ids: list[str] = field(default_factory=list)
    channel_error: str = ""
    tier: str = "disk"  # "memory": committed once in memory on every rank and replicated


class MemorySteps:
    """The memory-tier methods of :class:`trainer.guard.SnapshotGuard` (it sets every attribute used here)."""

    memory: Any
    distributed: bool
    world: int
    control_group: Any

    def _step_memory(self, step: int, local: int, due: bool, mem_due: bool) -> None:
        """A check step with the memory tier on (see the module docstring for the order)."""
        disk_busy = self._inflight is not None and not self._inflight.write.done()
        pending = self._agree_start(local, self.memory.replica_wait(), disk_busy)
        early = self._stage_early(step) if mem_due else None
        requested, mem_busy, disk_busy = self._agree_end(pending)
        self._disk_owed = self._disk_owed or due
        self._last_step = step
        if requested == NONE:
            disk_now = self._disk_owed and not disk_busy
            if not (disk_now or mem_due):
                return
            if disk_now:
                self._wait_inflight()  # done on every rank (disk_busy is agreed): reaps it, frees its slot
            state_dict, reused, build = early[0] if early else self._staged_state()
            # a replica round still running (a slow partner) or its budget's pause: the round is skipped, never
            # the step held; the own copy is taken when a slot is free, a disk snapshot staged (MemoryTier.take)
            slot = self.memory.take(step, state_dict, due=mem_due, replicate=not mem_busy, disk=disk_now,
                                    reuse=reused, build_seconds=build, staged=early[1] if early else None)
            if disk_now:
                self._disk_owed = False
                self._persist(step, SNAPSHOT, {}, set(), slot, state_dict)
            return
        requests, self._pending = self._pending, {}
        ids, hold = self._exchange(requests)
        if mem_busy:
            self.memory.wait_idle()  # a request is served at this step: wait for the previous copy
        if disk_busy:
            self._wait_inflight()
        state_dict, reused, build = early[0] if early else self._staged_state()
        job = self.memory.snapshot(step, state_dict, reuse=reused, build_seconds=build,
                                   staged=early[1] if early else None)
        if requested == MIGRATE:
            self._migrate_from_memory(step, job, requests, ids, hold, state_dict)
        else:
            self._disk_owed = False
            self._persist(step, SNAPSHOT, requests, ids, job.slot, state_dict)

    def _migrate_from_memory(self, step: int, job: Any, requests: dict[str, Request], ids: set[str], hold: float,
                             state_dict: Any) -> None:
        job.done.wait(self.memory.timeout)
        job.ok = self._memory_agreed(step)
        memory_ack = job.ok and self.migrate_ack == "memory"
        if memory_ack:
            requests, ids, hold = self._join_late(requests, ids, hold)
        if memory_ack and not self._leaving_with_every_copy(step):
            self._commit_in_memory(step, requests, ids)
            self._persist(step, MIGRATE, {}, ids, job.slot, state_dict)
        elif job.ok:  # durable: acknowledged once the disk copy commits (memory is restorable too)
            self._persist(step, MIGRATE, requests, ids, job.slot, state_dict)
            self._wait_inflight()
        else:  # not replicated everywhere: the migrate snapshot goes to disk, as without the tier
            log.error("migrate snapshot at step %d was not replicated (%s); writing it to disk first",
                      step, job.error or "timed out")
            self._persist(step, MIGRATE, requests, ids, job.slot, state_dict)
            self._wait_inflight()
        self._hold(step, max(self.migrate_hold_seconds, hold))

    def _stage_early(self, step: int) -> tuple[tuple[dict[str, Any], bool, float], Any] | None:
        """This step's own copy, taken while the agreement is in flight, into a slot free before it
        (``None`` before the tier's first snapshot, which is collective, or when no slot is free yet)."""
        if not self.memory.own or self.memory.free_slot() is None:
            return None
        staged = self._staged_state()
        return staged, self.memory.stage(step, staged[0], reuse=staged[1], build_seconds=staged[2])

    def _flush_owed(self) -> None:
        """Write the owed disk snapshot from memory (collective; see :meth:`close`)."""
        step = self._last_step
        self.memory.wait_idle()  # the agreed step is the same on every rank once every copy ended
        self._wait_inflight()
        state_dict, reused, build = self._staged_state()
        if self._memory_agreed(step) and self.memory.replicator is not None:
            slot = self.memory.replicator.agreed_slot
        else:  # the last memory snapshot was late (or failed): the live state is still that step's
            slot = self.memory.stage(step, state_dict, reuse=reused, build_seconds=build)
            self.memory.disk_only += 1
        self._disk_owed = False
        self.flushed_at_close = step
        log.info("writing the disk snapshot owed at the end (step %d) from memory", step)
        self._persist(step, SNAPSHOT, {}, set(), slot, state_dict)
        self._wait_inflight()

    def _staged_state(self) -> tuple[dict[str, Any], bool, float]:
        """(the state dict to stage, whether it is the previous snapshot's with the same tensors,
        seconds it took to get). On the first memory snapshot (collective: every rank reaches it
        at the same step) the tier checks its budget and maps its slots."""
        t0 = time.perf_counter()
        state_dict, reused = self._staging.get()
        build = time.perf_counter() - t0
        if not self.memory.own:
            self.memory.setup(state_dict)
        return state_dict, reused, build

    def _agree_start(self, local: int, mem_busy: bool, disk_busy: bool) -> MaxAgreement:
        """Start the agreement (see :meth:`_agree_all`); :meth:`_agree_end` completes it."""
        flag = torch.tensor([local, int(mem_busy), int(disk_busy), -self.memory.done_step()], dtype=torch.int64)
        return MaxAgreement(flag, self.control_group, self.world if self.distributed else 1)

    def _agree_end(self, pending: MaxAgreement) -> tuple[int, bool, bool]:
        flag = pending.wait().tolist()
        self.memory.agree(-flag[3])
        return flag[0], bool(flag[1]), bool(flag[2])

    def _agree_all(self, local: int, mem_busy: bool, disk_busy: bool) -> tuple[int, bool, bool]:
        """One agreement (an all-reduce MAX: :mod:`trainer.agree`): the strongest request any rank holds, whether any rank's replica copy or disk write
        still runs (every rank skips or waits alike), the least step all replica rounds succeeded at (agreed)."""
        return self._agree_end(self._agree_start(local, mem_busy, disk_busy))

    def _memory_agreed(self, step: int) -> bool:
        """Collective: whether every rank's replica round of ``step`` succeeded (call once it ended)."""
        self._agree_all(NONE, False, False)
        return self.memory.agreed_step == step

    def _commit_in_memory(self, step: int, requests: dict[str, Request], ids: set[str]) -> None:
        """The migrate snapshot is in memory on every rank and replicated: acknowledge it as
        committed now (the drain can start); the disk copy follows in the background."""
        self._mark_served(ids, step)
        path = f"memory:{snapshot_path(self.directory, step)}"
        blocked = self.memory.stalls[-1] if self.memory.stalls else 0.0
        size = self.memory.layout.data_len if self.memory.layout else 0
        self.records.append(SnapshotRecord(step, path, blocked, blocked, "migrate", True, "", size,
                                           sorted(ids), self.channel_error, tier="memory"))
        for req in requests.values():
            for phase in ("staged", "committed"):
                self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=step, ok=True, path=path,
                                      blocked_seconds=round(blocked, 6), pid=os.getpid(), request_type=req.type,
                                      phase=phase, bytes=size))
        log.warning("migrate snapshot at step %d committed in memory and replicated", step)

    def _join_late(self, requests: dict[str, Request], ids: set[str], hold: float) -> tuple[dict, set[str], float]:
        """Collective: requests that reached a rank while the migrate snapshot replicated (the daemons of
        adjacent victims trip together, their datagrams a step boundary apart) join this migration, so the
        leaving set that decides a memory-only ack sees every node asked by then."""
        if self.endpoint.active:
            self._receive(self.endpoint.poll())
        late, self._pending, leaving = self._pending, {}, self._leaving
        more, more_hold = self._exchange(late)
        self._leaving |= leaving
        return {**requests, **late}, ids | more, max(hold, more_hold)

    def _leaving_with_every_copy(self, step: int) -> list[int]:
        """The nodes leaving in this migration whose replica holder leaves too (agreed: every
        rank computes it from the same exchange). An ack of the memory snapshot alone would let
        every copy of their shards go with them: their migrate snapshot is acknowledged once on disk."""
        local = self.memory.local_world
        exposed = nodes_left_without_a_copy(self.memory.node_holder, {r // local for r in self._leaving})
        if exposed and self.migrate_ack == "memory":
            log.warning("migrate snapshot at step %d: node(s) %s leave with every memory copy of their shards "
                        "(their replica holders leave too); acknowledged once on disk", step, exposed)
        return exposed
