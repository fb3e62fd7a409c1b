"""SnapshotGuard: the smallest API a training loop adopts.

Contract
--------
* ``resume()`` (collective) loads the newest *complete* snapshot — one whose commit marker
  exists — resharding when the world size changed, and returns the step to continue from (0
  when there is none). A newest snapshot that fails to load is skipped with a warning and the
  previous one is used. A snapshot interrupted halfway has no marker and is never loaded.
* ``step(step)`` (collective every ``check_every`` steps) is called after the step's optimizer
  update. It reads the local control channel (non-blocking), then all ranks agree with one tiny
  all-reduce on whether to snapshot at this same step: the daemon reaches only its own node's
  ranks, and a DCP save is collective, so deciding per rank would deadlock.
* Snapshots are ``dcp.async_save`` on a checkpoint process group of their own (gloo): the loop
  is blocked only while state is staged to host memory; the write continues in the background.
  The commit marker is written by rank 0 once the save completed on every rank (DCP writes its
  metadata only after gathering every rank's writes). Retention keeps the last ``keep``.
* After a ``migrate`` request the ranks wait for the write to finish, acknowledge, and hold at
  that step (a heartbeat all-reduce every ``HOLD_BEAT`` s) until the node is drained — a dead
  peer makes the heartbeat raise :class:`NodeDrained` so torchrun restarts the workers onto the
  spare — or ``migrate_hold_seconds`` pass, after which training simply continues.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from sentinel.channel import Ack, NullEndpoint, RankEndpoint, Request

log = logging.getLogger("sentinel.trainer")

MARKER = "COMMITTED"
PREFIX = "step-"
HOLD_BEAT = 0.2
NONE, SNAPSHOT, MIGRATE = 0, 1, 2


class NodeDrained(RuntimeError):
    """A peer left during the migrate hold: the node was drained; exit so torchrun restarts."""


class ModelOptimState(Stateful):
    """Model + optimizer as one DCP Stateful, through torch.distributed.checkpoint.state_dict
    (FSDP2 DTensor shards are saved as shards and resharded on load)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def snapshot_path(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step:09d}"


def complete_snapshots(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of snapshots with a commit marker, newest first."""
    out = []
    directory = Path(directory)
    if not directory.is_dir():
        return out
    for p in directory.iterdir():
        if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit() and (p / MARKER).is_file():
            out.append((int(p.name[len(PREFIX):]), p))
    return sorted(out, reverse=True)


@dataclass
class _Inflight:
    step: int
    path: Path
    upload: Future
    requests: list[Request]
    blocked: float
    kind: int
    started: float


@dataclass
class SnapshotRecord:
    step: int
    path: str
    blocked_seconds: float
    total_seconds: float
    kind: str
    ok: bool
    error: str = ""


class SnapshotGuard:
    def __init__(
        self,
        directory: str | os.PathLike,
        state: Mapping[str, Any],
        *,
        interval_steps: int = 0,
        check_every: int = 1,
        keep: int = 3,
        migrate_hold_seconds: float = 60.0,
        async_save: bool = True,
        group: Any = None,
        endpoint: RankEndpoint | NullEndpoint | None = None,
    ) -> None:
        if check_every < 1:
            raise ValueError("check_every must be >= 1")
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = Path(directory)
        self.state = dict(state)
        self.interval_steps = interval_steps
        self.check_every = check_every
        self.keep = keep
        self.migrate_hold_seconds = migrate_hold_seconds
        self.async_save = async_save
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        # Checkpointing gets its own gloo group: async_save on the training group while training
        # collectives run crashed or hung here (gloo size mismatch). The agreement and hold
        # collectives run on the training thread while a background save may be mid-collective,
        # so they get a third group: two threads must never share one gloo group.
        self.group = group if group is not None else (dist.new_group(backend="gloo") if self.distributed else None)
        self.control_group = dist.new_group(backend="gloo") if self.distributed else None
        self.endpoint = endpoint if endpoint is not None else RankEndpoint.open()
        self._pending: list[Request] = []
        self._inflight: _Inflight | None = None
        self._stager = None
        self.records: list[SnapshotRecord] = []
        self.resumed_from: Path | None = None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- resume ---------------------------------------------------------------------------------
    def resume(self) -> int:
        """Collective. Load the newest complete snapshot; the step to start from (0 if none)."""
        for step, path in complete_snapshots(self.directory):
            try:
                dcp.load(self.state, checkpoint_id=str(path), process_group=self.group)
            except (CheckpointException, Exception) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                log.warning("snapshot %s could not be loaded (%s); trying the previous one", path, exc)
                continue
            self.resumed_from = path
            log.info("resumed from %s", path)
            return step + 1
        return 0

    # -- the per-step hook ------------------------------------------------------------------------
    def step(self, step: int) -> None:
        if self._inflight is not None and self._inflight.upload.done():
            self._reap()
        if self.endpoint.active:
            self._pending.extend(self.endpoint.poll())
        due = self.interval_steps > 0 and (step + 1) % self.interval_steps == 0
        if step % self.check_every != 0 and not due:
            return
        local = max((MIGRATE if r.type == "migrate" else SNAPSHOT for r in self._pending), default=NONE)
        decision = max(self._agree(local), SNAPSHOT if due else NONE)
        if decision == NONE:
            return
        requests, self._pending = self._pending, []
        self._snapshot(step, decision, requests)
        if decision == MIGRATE:
            self._wait_inflight()
            self._hold(step)

    def _agree(self, local: int) -> int:
        if not self.distributed or self.world == 1:
            return local
        flag = torch.tensor([local], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        return int(flag.item())

    def _snapshot(self, step: int, kind: int, requests: list[Request]) -> None:
        self._wait_inflight()  # one save at a time; staging buffers are reused
        path = snapshot_path(self.directory, step)
        t0 = time.perf_counter()
        if self.async_save:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self._stager is None:
                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda))
            resp = dcp.async_save(self.state, checkpoint_id=str(path), process_group=self.group,
                                  async_stager=self._stager)
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()  # state may change at the next step: wait for the copy
                upload = resp.upload_completion
            else:
                upload = resp
        else:
            upload = Future()
            try:
                dcp.save(self.state, checkpoint_id=str(path), process_group=self.group)
                upload.set_result(None)
            except (CheckpointException, Exception) as exc:  # noqa: BLE001 - recorded and acknowledged as a failure
                upload.set_exception(exc)
        blocked = time.perf_counter() - t0
        self._inflight = _Inflight(step, path, upload, requests, blocked, kind, t0)

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            try:
                self._inflight.upload.result()
            except (CheckpointException, Exception):  # noqa: BLE001 - _reap records it
                pass
            self._reap()

    def _reap(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        error = ""
        try:
            inflight.upload.result()
        except (CheckpointException, Exception) as exc:  # noqa: BLE001 - a failed snapshot is reported, never committed
            error = f"{type(exc).__name__}: {exc}"
            log.error("snapshot at step %d failed: %s", inflight.step, error)
        if not error and self.rank == 0:
            try:
                self._commit(inflight)
            except OSError as exc:
                error = f"commit failed: {exc}"
        total = time.perf_counter() - inflight.started
        kind = "migrate" if inflight.kind == MIGRATE else "snapshot"
        self.records.append(SnapshotRecord(inflight.step, str(inflight.path), inflight.blocked, total, kind, not error, error))
        for req in inflight.requests:
            self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=inflight.step, ok=not error,
                                  path=str(inflight.path), blocked_seconds=round(inflight.blocked, 6),
                                  error=error, pid=os.getpid(), request_type=req.type))

    def _commit(self, inflight: _Inflight) -> None:
        marker = {"step": inflight.step, "world_size": self.world, "time": time.time(),
                  "blocked_seconds": inflight.blocked, "kind": "migrate" if inflight.kind == MIGRATE else "snapshot"}
        tmp = inflight.path / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(marker))
        with open(tmp) as f:
            os.fsync(f.fileno())
        os.replace(tmp, inflight.path / MARKER)
        self._retain(inflight.step)

    def _retain(self, newest: int) -> None:
        complete = complete_snapshots(self.directory)
        for _, path in complete[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        kept = {p for _, p in complete[: self.keep]}
        for p in self.directory.iterdir():
            if p.name.startswith(PREFIX) and p not in kept and p.name[len(PREFIX):].isdigit():
                if int(p.name[len(PREFIX):]) < newest:  # abandoned partial snapshots
                    shutil.rmtree(p, ignore_errors=True)

    def _hold(self, step: int) -> None:
        """Hold at this step until the node is drained (a peer vanishes) or the hold expires."""
        log.warning("migrate snapshot at step %d committed; holding up to %.0f s for the drain", step,
                    self.migrate_hold_seconds)
        beats = max(1, math.ceil(self.migrate_hold_seconds / HOLD_BEAT))  # the same count on every rank
        flag = torch.zeros(1, dtype=torch.int32)
        for _ in range(beats):
            self._answer_while_holding()
            if self.distributed and self.world > 1:
                try:
                    dist.all_reduce(flag, group=self.control_group)
                except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError on a dead peer
                    raise NodeDrained(f"a peer left during the migrate hold at step {step}: {exc}") from exc
            time.sleep(HOLD_BEAT)
        log.warning("no drain within %.0f s; training continues", self.migrate_hold_seconds)

    def _answer_while_holding(self) -> None:
        """A request that arrives during the hold (another node's daemon tripped too) is answered
        by the snapshot just committed: same step, already durable. Without this, that node's
        daemon would wait for acks from ranks that are about to be restarted."""
        if not self.endpoint.active or not self.records:
            return
        last = self.records[-1]
        for req in self.endpoint.poll():
            self.endpoint.ack(Ack(id=req.id, rank=self.rank, step=last.step, ok=last.ok, path=last.path,
                                  blocked_seconds=0.0, error=last.error, pid=os.getpid(), request_type=req.type))

    def close(self) -> None:
        self._wait_inflight()
        if self._stager is not None:
            self._stager.close()
        self.endpoint.close()
