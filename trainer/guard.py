"""SnapshotGuard: the smallest API a training loop adopts.

Contract
--------
* ``resume()`` (collective) loads the newest *complete* snapshot — one whose commit marker
  exists — resharding when the world size changed, and returns the step to continue from (0
  when there is none). Rank 0 alone lists the directory (ranks listing markers on NFS or Lustre
  can disagree) and broadcasts its choice over the checkpoint group; after every load all ranks
  agree on whether it worked, and on a failure rank 0 picks the previous snapshot, again
  broadcast. So every rank loads the same path, or every rank starts at 0. A snapshot that failed
  to load is renamed aside by rank 0 (``step-000000123.corrupt-<unix time>``), so a later save
  at the same step never inherits its commit marker. A snapshot interrupted halfway has no marker
  and is never loaded.
* ``step(step)`` (collective every ``check_every`` steps) is called after the step's optimizer
  update. It reads the local control channel (non-blocking), then all ranks agree with one tiny
  all-reduce MAX on whether to snapshot at this same step: the daemon reaches only its own node's
  ranks, and a DCP save is collective, so deciding per rank would deadlock. (The all-reduce is
  :mod:`trainer.agree`'s dissemination: log2(world) rounds, not gloo's ring; with the memory tier,
  :mod:`trainer.guard_memory` takes the step's own copy while it runs.) When requests are
  being served, the ranks also exchange their request ids (rare: only on those steps).
* One request id, at most one snapshot. Every rank remembers the last ``SERVED_IDS`` ids served
  by any rank's request; a request whose id was already served (it reached this rank late, or a
  restarted daemon re-sent it) is answered from the snapshot that served it and never starts a
  second one.
* Acknowledgements come in two phases: ``staged`` (with the staged state's size in bytes) as soon
  as the state is in host memory and the write has begun, then ``committed`` (``ok`` false when
  the write failed) once the write is durable.
* Snapshots are ``dcp.async_save`` on a checkpoint process group of their own (gloo), committed
  by rank 0's marker, the last ``keep`` retained: see :mod:`trainer.disk`.
* After a ``migrate`` request the ranks wait for the write to finish, acknowledge, and hold at
  that step (a heartbeat all-reduce every ``HOLD_BEAT`` s) until the node is drained — a dead
  peer makes the heartbeat raise :class:`NodeDrained` so torchrun restarts the workers onto the
  spare — or the hold passes, after which training simply continues. The hold lasts at least
  ``max(migrate_hold_seconds, request.hold_seconds)`` (the largest any rank received): the
  daemon asks for its ack timeout plus its drain budget. Requests that arrive during the hold
  are answered at once from the snapshot just committed.
* A rank whose control socket had trouble (its path was squatted by another user, or it could
  not bind one at all and runs without the daemon) logs an ERROR at start and keeps the reason in
  :attr:`SnapshotGuard.channel_error`, in every :class:`SnapshotRecord` and in
  :meth:`SnapshotGuard.summary`: never a silent loss of the channel.

The guard only coordinates (the channel, the agreement, the hold); the tiers store (:mod:`trainer.disk`,
:mod:`trainer.memory`); :mod:`trainer.hold` is how a hold ends; :mod:`trainer.progress` watches each
step for hangs and stragglers.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from sentinel.channel import Ack, NullEndpoint, RankEndpoint, Request
from trainer.agree import agree_max
from trainer.disk import (  # noqa: F401 - re-exported: trainer.guard's names from before the split
    CORRUPT, MARKER, PREFIX, DiskTier, DiskWrite, complete_snapshots, snapshot_path, staged_bytes)
from trainer.fence import generation_from_env
from trainer.guard_memory import MIGRATE, NONE, SNAPSHOT, MemorySteps, SnapshotRecord  # noqa: F401 - re-exported
from trainer.hold import NodeDrained, hold_for_drain  # noqa: F401 - NodeDrained re-exported
from trainer.memory import MemoryTier, MemoryTierError, RestoreResult, default_holder_dir
from trainer.progress import JobWatch
from trainer.state import ModelOptimState, StagingState  # noqa: F401 - ModelOptimState re-exported

log = logging.getLogger("sentinel.trainer")

# How often a holding rank's heartbeat all-reduce runs: a survivor notices that the drained node's
# workers exited at its next beat (its agent's SIGTERM may come first). 0.2 s cost up to 0.2 s of
# every hand-over where the heartbeat came first (torch's c10d rendezvous: its agents see a waiting
# spare through a 1 s cache); a tiny all-reduce every 0.05 s while training is paused costs nothing.
HOLD_BEAT = 0.05
SERVED_IDS = 256
# The daemon's default ack timeout (120 s) plus a drain budget: a hold must outlast both, or the
# ranks would go back to training just before the node is drained.
DEFAULT_MIGRATE_HOLD_SECONDS = 180.0


@dataclass
class _Inflight:
    """The disk write in flight, and the requests it answers."""

    write: DiskWrite
    requests: dict[str, Request]
    kind: int


def _side_group() -> Any:
    """A gloo group with the job's own timeout (``new_group``'s default is 30 min: a survivor's
    collective with a powered-off peer, no RST, then never failed and never re-joined)."""
    try:
        timeout = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):  # no gloo/CPU backend: torch's default
        timeout = None
    return dist.new_group(backend="gloo", timeout=timeout)


class SnapshotGuard(MemorySteps):
    def __init__(self, directory: str | os.PathLike, state: Mapping[str, Any], *, interval_steps: int = 0,
                 check_every: int = 1, keep: int = 3, migrate_hold_seconds: float = DEFAULT_MIGRATE_HOLD_SECONDS,
                 async_save: bool = True, group: Any = None, endpoint: RankEndpoint | NullEndpoint | None = None,
                 memory_interval_steps: int = 0, memory_dir: str | os.PathLike | None = None,
                 memory_run_id: str | None = None, local_world_size: int | None = None,
                 replica_bytes_per_second: float = 0.0, memory_timeout: float = 120.0,
                 migrate_ack: str = "durable", progress: Mapping[str, Any] | None = None, disk: Any = None) -> None:
        if check_every < 1:
            raise ValueError("check_every must be >= 1")
        if keep < 1:
            raise ValueError("keep must be >= 1")
        if memory_interval_steps < 0:
            raise ValueError("memory_interval_steps must be >= 0 (0: no memory tier)")
        if migrate_ack not in ("durable", "memory"):
            raise ValueError(f"migrate_ack must be 'durable' or 'memory' (got {migrate_ack!r})")
        # When a migrate snapshot is acknowledged (the daemon drains right after the ack):
        # "durable" — once it is on disk too (and, with the tier, in memory and replicated, which
        # the spare restores from); "memory" — as soon as it is in memory and replicated, the disk
        # copy following during the hold. "memory" starts the drain sooner by the disk write, but
        # the drain kills the ranks before that copy commits: when two adjacent nodes (each the
        # other's replica holder) migrate together, both copies of their shards leave with them
        # and the job falls back to the previous disk snapshot (measured: 7 steps lost in 2 of 6
        # two-victim drills). Hence "durable" by default.
        self.migrate_ack = migrate_ack
        self.directory = Path(directory)
        self.state = dict(state)
        self.interval_steps = interval_steps
        self.check_every = check_every
        self.migrate_hold_seconds = migrate_hold_seconds
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # Checkpointing gets its own gloo group: async_save on the training group while training
        # collectives run crashed or hung here (gloo size mismatch). The agreement and hold
        # collectives run on the training thread while a background save may be mid-collective,
        # so they get a third group: two threads must never share one gloo group.
        self.group = group if group is not None else (_side_group() if self.distributed else None)
        self.control_group = _side_group() if self.distributed else None
        self.endpoint = endpoint if endpoint is not None else RankEndpoint.open()
        # "" when the channel is fine (or no daemon is installed); otherwise why this rank cannot
        # be reached, e.g. its socket path was squatted. The job runs on, but never silently.
        self.channel_error: str = getattr(self.endpoint, "error", "") or ""
        if self.channel_error:
            log.error("rank %d: control channel problem: %s", self.rank, self.channel_error)
        self._pending: dict[str, Request] = {}
        self._leaving: set[int] = set()  # the ranks the last exchange's migrate requests reached
        self._served: OrderedDict[str, int] = OrderedDict()  # request id -> step of the snapshot that served it
        self._inflight: _Inflight | None = None
        self.records: list[SnapshotRecord] = []
        self.resumed_from: Path | str | None = None  # str: "memory:step-..."
        self.skipped_on_resume: list[Path] = []
        self.memory_interval_steps = memory_interval_steps
        self.restore_info: RestoreResult | None = None
        self._disk_owed = False
        self._last_step = -1  # the newest step passed to step(): what close() persists when owed
        self._step_failed = False
        self.flushed_at_close: int | None = None  # the step close() wrote to disk because it was owed
        self._staging = StagingState(self.state)
        self.memory: MemoryTier | None = None
        if memory_interval_steps > 0:
            self.memory = self._open_memory(memory_dir, memory_run_id, local_world_size,
                                            bytes_per_second=replica_bytes_per_second, timeout=memory_timeout)
        # ``disk``: another writer with DiskTier's interface (trainer.integrations.torchtitan: the trainer's own
        # checkpoint manager writes and loads; the guard still decides when, and which snapshot)
        self.disk = disk if disk is not None else DiskTier(
            self.directory, group=self.group, rank=self.rank, world=self.world, keep=keep, async_save=async_save,
            generation=generation_from_env())
        self.watch = JobWatch.open(self, **(progress or {}))  # hangs, stragglers: trainer.progress (its options)

    def _open_memory(self, directory: str | os.PathLike | None, run_id: str | None, local_world: int | None,
                     **options: float) -> MemoryTier:
        run_id = run_id or os.environ.get("TORCHELASTIC_RUN_ID", "")
        if not run_id:
            raise MemoryTierError("the memory tier needs a run id to tell this job's memory from an older "
                                  "one's: run under torchrun (it sets TORCHELASTIC_RUN_ID) or pass memory_run_id=")
        local_world = local_world or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        # The replica copy runs on a thread of its own: its own gloo group (two threads never
        # share one), never the training group nor the disk tier's.
        replica_group = _side_group() if self.distributed else None
        return MemoryTier(directory or default_holder_dir(), run_id=run_id, rank=self.rank, world=self.world,
                          local_world=local_world, group=replica_group, **options)

    # -- resume ---------------------------------------------------------------------------------
    def resume(self) -> int:
        """Collective. Load the newest complete snapshot; the step to start from (0 if none).

        Rank 0 decides which snapshot (and, after a failed load, which one next); every rank
        loads exactly that one. Raises only what the collectives raise."""
        candidates = self.disk.snapshots() if self.rank == 0 else []
        if self.memory is not None:
            newest = self._from_rank0(candidates[0] if candidates else None)
            self._staging.clear()  # a load may replace the live tensors
            read_disk = None if newest is None else functools.partial(self.disk.read_part, Path(newest[1]))
            info = self.memory.restore(self._live_state, newest[0] if newest is not None else -1, read_disk)
            self.restore_info = info
            if info.tier == "memory":
                self._load_live(self._restored_state)
                self.resumed_from = f"memory:step-{info.step:09d}"
                log.info("resumed from memory at step %d (%d shard(s) from this node's memory, %d from a peer's "
                         "replica, %d from the disk snapshot of that step) in %.3f s", info.step, len(info.local),
                         len(info.peer), len(info.disk), info.seconds)
                return info.step + 1
            if newest is not None or info.reason != "no memory snapshot of this run":
                log.warning("memory tier: %s; falling back to the newest disk snapshot (%s)", info.reason,
                            f"step {newest[0]}" if newest is not None else "none")
        tried = 0
        while True:
            choice = candidates[tried] if tried < len(candidates) else None
            choice = self._from_rank0(choice)
            if choice is None:
                if self.skipped_on_resume:
                    log.error("no snapshot could be loaded (%d skipped); starting at step 0", len(self.skipped_on_resume))
                return 0
            step, path = choice[0], Path(choice[1])
            error = self.disk.load(self.state, path)
            if self._all_ok(not error):
                self.resumed_from = path
                log.info("resumed from %s", path)
                return step + 1
            log.warning("snapshot %s could not be loaded (%s); trying the previous one", path,
                        error or "failed on another rank")
            self.skipped_on_resume.append(path)
            if self.rank == 0:
                self.disk.set_aside(path)
            tried += 1

    def _live_state(self) -> dict[str, Any]:
        self._restored_state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in self.state.items()}
        return self._restored_state

    def _load_live(self, state_dict: Mapping[str, Any]) -> None:
        for k, v in self.state.items():
            if isinstance(v, Stateful):
                v.load_state_dict(state_dict[k])

    def _from_rank0(self, obj: Any) -> Any:
        if not self.distributed or self.world == 1:
            return obj
        box = [(obj[0], str(obj[1])) if obj is not None else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if not self.distributed or self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # -- the per-step hook ------------------------------------------------------------------------
    def step(self, step: int) -> None:
        self._step_failed = True  # until it returns: close() then writes nothing collective
        self._step(step)
        self._step_failed = False
        self.watch.on_step(step)

    def _step(self, step: int) -> None:
        if self._inflight is not None and self._inflight.write.done():
            self._reap()
        if self.memory is not None:
            self.memory.after_agreed()
        if self.endpoint.active:
            self._receive(self.endpoint.poll())
        due = self.interval_steps > 0 and (step + 1) % self.interval_steps == 0
        mem_due = self.memory is not None and (step + 1) % self.memory_interval_steps == 0
        if step % self.check_every != 0 and not due and not mem_due and not self._disk_owed:
            return
        local = max((MIGRATE if r.type == "migrate" else SNAPSHOT for r in self._pending.values()), default=NONE)
        if self.memory is None:
            requested = self._agree(local)
            decision = max(requested, SNAPSHOT if due else NONE)
            if decision == NONE:
                return
            requests, self._pending = self._pending, {}
            ids, hold = self._exchange(requests) if requested != NONE else (set(), 0.0)
            self._snapshot(step, decision, requests, ids)
            if decision == MIGRATE:
                self._wait_inflight()
                self._hold(step, max(self.migrate_hold_seconds, hold))
            return
        self._step_memory(step, local, due, mem_due)

    def _mark_served(self, ids: set[str], step: int) -> None:
        for rid in sorted(ids):
            self._served[rid] = step
            self._served.move_to_end(rid)
        while len(self._served) > SERVED_IDS:
            self._served.popitem(last=False)

    def _persist(self, step: int, kind: int, requests: dict[str, Request], ids: set[str], slot: Any,
                 state_dict: Mapping[str, Any]) -> None:
        """The disk tier from memory: DCP writes the staged slot on a background thread (on the
        checkpoint group, used by nothing else meanwhile); the loop is not blocked by it."""
        self._wait_inflight()
        self._mark_served(ids, step)
        self.memory.pinned = slot  # the disk write reads it: never staged into until it is reaped
        write = self.disk.save_copy(step, lambda: self.memory.disk_state(slot, state_dict),
                                    self.memory.layout.data_len)
        self._ack_staged(write, list(requests.values()))
        self._inflight = _Inflight(write, requests, kind)

    def _receive(self, requests: list[Request]) -> None:
        """New requests become pending; an id already pending or already served starts nothing."""
        for req in requests:
            if req.id in self._pending:
                continue
            if req.id in self._served:
                self._answer_served(req)
            else:
                self._pending[req.id] = req

    def _answer_served(self, req: Request) -> None:
        step = self._served[req.id]
        inflight = self._inflight
        if inflight is not None and inflight.write.step == step:
            if req.id not in inflight.requests:
                inflight.requests[req.id] = req
                self._ack_staged(inflight.write, [req])
            return  # the committed ack follows when the write completes
        record = next((r for r in reversed(self.records) if r.step == step), None)
        if record is None:
            log.warning("request %s was served by the snapshot at step %d, which has no record here", req.id, step)
            return
        log.info("request %s was already served by the snapshot at step %d; answering from it", req.id, step)
        self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=record.step, ok=record.ok, path=record.path,
                              blocked_seconds=0.0, error=record.error, pid=os.getpid(), request_type=req.type,
                              phase="committed", bytes=record.bytes))

    def _agree(self, local: int) -> int:
        if not self.distributed or self.world == 1:
            return local
        return agree_max([local], self.control_group, self.world)[0]  # log2(world) rounds: trainer.agree

    def _exchange(self, requests: Mapping[str, Request]) -> tuple[set[str], float]:
        """Every rank's request ids (so a copy that reaches a rank later is known as served) and
        the longest hold any migrate request asked for."""
        mine = [(r.id, r.hold_seconds if r.type == "migrate" else 0.0, r.type == "migrate") for r in requests.values()]
        if self.distributed and self.world > 1:
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self.control_group)
        else:
            everyone = [mine]
        # the ranks a migrate request reached: their nodes are leaving (the same set on every rank)
        self._leaving = {r for r, part in enumerate(everyone) if any(m for _, _, m in part)}
        pairs = [p for part in everyone for p in part]
        return {i for i, _, _ in pairs}, max((h for _, h, _ in pairs), default=0.0)

    def _snapshot(self, step: int, kind: int, requests: dict[str, Request], ids: set[str]) -> None:
        self._wait_inflight()  # one save at a time; staging buffers are reused
        self._mark_served(ids, step)
        write = self.disk.save(step, lambda: {k: v.state_dict() if isinstance(v, Stateful) else v
                                              for k, v in self.state.items()},
                               staged=lambda w: self._ack_staged(w, list(requests.values())))
        self._inflight = _Inflight(write, requests, kind)

    def _ack_staged(self, write: DiskWrite, requests: list[Request]) -> None:
        for req in requests:
            self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=write.step, ok=True, path=str(write.path),
                                  blocked_seconds=round(write.blocked, 6), pid=os.getpid(), request_type=req.type,
                                  phase="staged", bytes=write.bytes))

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            self._reap()  # waits for the write

    def _reap(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        if self.memory is not None:
            self.memory.pinned = None
        write = inflight.write
        kind = "migrate" if inflight.kind == MIGRATE else "snapshot"
        served = [rid for rid, step in self._served.items() if step == write.step]
        error = self.disk.finish(write, kind=kind, request_ids=sorted(served))
        total = time.perf_counter() - write.started
        self.records.append(SnapshotRecord(write.step, str(write.path), write.blocked, total, kind, not error,
                                           error, write.bytes, served, self.channel_error))
        for req in inflight.requests.values():
            self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=write.step, ok=not error,
                                  path=str(write.path), blocked_seconds=round(write.blocked, 6),
                                  error=error, pid=os.getpid(), request_type=req.type,
                                  phase="committed", bytes=write.bytes))

    def _hold(self, step: int, seconds: float) -> None:
        """Hold at this step until the node is drained (a peer vanishes) or ``seconds`` pass (the same
        on every rank, agreed in _exchange): :func:`trainer.hold.hold_for_drain`, a heartbeat all-reduce a beat."""
        flag = torch.zeros(1, dtype=torch.int32)
        multi = self.distributed and self.world > 1
        hold_for_drain(step, seconds, HOLD_BEAT, between=self._between_beats,
                       heartbeat=(lambda: dist.all_reduce(flag, group=self.control_group)) if multi else None)

    def _between_beats(self) -> None:
        if self._inflight is not None and self._inflight.write.done():
            self._reap()  # the migrate snapshot committed in memory is now on disk: its marker
        self._answer_while_holding()

    def _answer_while_holding(self) -> None:
        """A request that arrives during the hold (another node's daemon tripped too) is answered
        by the snapshot just committed: same step, already durable. Without this, that node's
        daemon would wait for acks from ranks that are about to be restarted. A request id seen
        before is answered from the snapshot that served it."""
        if not self.endpoint.active or not self.records:
            return
        last = self.records[-1]
        for req in self.endpoint.poll():
            if req.id not in self._served:
                self._mark_served({req.id}, last.step)
                last.request_ids.append(req.id)
            self._answer_served(req)

    def summary(self) -> dict[str, Any]:
        """What this rank's guard did, for logs and a job's final report."""
        return {
            "rank": self.rank, "channel_error": self.channel_error,
            "resumed_from": str(self.resumed_from or ""),
            "skipped_on_resume": [str(p) for p in self.skipped_on_resume],
            "snapshots": len(self.records), "failed_snapshots": sum(not r.ok for r in self.records),
            "requests_served": len(self._served),
            "last": asdict(self.records[-1]) if self.records else None,
            "memory": self.memory_summary(),
        }

    def memory_summary(self) -> dict[str, Any] | None:
        """The memory tier's figures on this rank (None when it is off)."""
        return None if self.memory is None else self.memory.summary(flushed_at_close=self.flushed_at_close)

    def restore_summary(self) -> dict[str, Any]:
        """Where resume() took the state from: tier memory (shards from this node / a peer) or disk."""
        if self.restore_info is None:
            return {"tier": "disk" if self.resumed_from else "none"}
        return self.restore_info.summary(from_disk=bool(self.resumed_from))

    def drain(self) -> None:
        """Block until the disk write and the replica copy in flight (if any) have finished (not
        collective). Benchmarks call it between phases so that no background work spills over."""
        self._wait_inflight()
        if self.memory is not None:
            self.memory.wait_idle()

    def close(self, *, flush: bool = True) -> None:
        """Finish: wait for the snapshot being written, and stop the memory tier. A disk snapshot still owed
        (due while the previous disk write or a replica copy ran) is written from memory with ``flush`` (the
        newest step passed to :meth:`step`), and the replica rounds that ended after the last step are agreed.
        Collective: every rank calls ``close()`` after the same last step. ``flush=False`` on an error path
        (peers may be gone); skipped as well when the last :meth:`step` raised."""
        self.watch.close(finish=flush and not self._step_failed)  # over: the final writes are no hung step
        if flush and self.memory is not None and self.memory.own and not self._step_failed:
            if self._disk_owed and self._last_step >= 0:
                self._flush_owed()
            self.memory.wait_idle()
            self._agree_all(NONE, False, False)
        self._wait_inflight()
        if self.memory is not None:
            self.memory.close()
        self.disk.close()
        self.endpoint.close()
