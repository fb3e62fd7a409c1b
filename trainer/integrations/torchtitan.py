"""Sentinel for TorchTitan, through its own checkpoint manager: no fork of its train loop.

TorchTitan's trainer calls its checkpoint manager after every step (``checkpointer.save(step,
last_step=...)``) and once at the start (``checkpointer.load(step=...)``). Here the manager is
:class:`SentinelCheckpointManager`, a subclass of torchtitan's ``CheckpointManager`` chosen in the
job's config (``checkpoint=SentinelCheckpointManager.Config(enable=True, ...)``):

* ``save(step)`` runs torchtitan's own periodic policy (its interval, async mode, last-step
  save, retention), then :meth:`SnapshotGuard.step`: when the daemon asks, every rank agrees on
  this step and torchtitan's ``dcp_save`` writes the checkpoint of this very step (``step-N`` in
  its folder, its state objects: model parts, ``OptimizersContainer``, ``LRSchedulersContainer``,
  the stateful data loader, ``train_state``) in the configured async mode; the daemon gets the
  staged and committed acks; a migrate request holds the ranks until the node is drained, and a
  drained rank exits 75 so that torchrun restarts the group on the spare.
* ``load()`` (the spare, or any restart) lets rank 0 pick the newest complete checkpoint (one
  with DCP's ``.metadata``, which DCP writes last) and every rank loads that one through
  torchtitan's own ``_load``; one that fails to load is set aside and the previous one is used.
  With no checkpoint, torchtitan's own first-start path runs (``initial_load_path``, HF weights).

The guard decides when and which; torchtitan's manager does the writing and the loading
(:class:`TitanTier`, the guard's disk tier here). No memory tier: the snapshot is torchtitan's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torchtitan.components.checkpoint import CheckpointManager

from trainer.disk import DiskTier, DiskWrite
from trainer.guard import DEFAULT_MIGRATE_HOLD_SECONDS, SnapshotGuard
from trainer.integrations.guarded import report_snapshots, step_or_leave
from trainer.integrations.progress import ProgressRecord

log = logging.getLogger("sentinel.trainer")



def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class TitanTier:
    """The guard's disk tier (DiskTier's interface) over torchtitan's ``CheckpointManager``:
    torchtitan's folder, naming (``step-N``), validity (``.metadata``), ``dcp_save`` with its own
    state flattening and async mode, ``_load`` and retention."""

    def __init__(self, manager: "SentinelCheckpointManager", rank: int) -> None:
        self.manager = manager
        self.rank = rank
        self.directory = Path(manager.folder)

    def snapshots(self) -> list[tuple[int, Path]]:
        """torchtitan's complete checkpoints (a ``step-N`` folder with DCP's ``.metadata``), newest first."""
        out = []
        if self.directory.is_dir():
            for p in self.directory.iterdir():
                digits = p.name[len("step-"):]
                if p.name.startswith("step-") and digits.isdigit() and (p / ".metadata").is_file():
                    out.append((int(digits), p))
        return sorted(out, reverse=True)

    def load(self, state: Any, path: Path) -> str:
        """Collective: torchtitan's own load of that step into its state objects. The error, "" if loaded."""
        step = int(Path(path).name[len("step-"):])
        try:
            loaded = CheckpointManager._load(self.manager, step=step)
        except Exception as exc:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException subclass) or others
            return f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # CheckpointException: every rank goes to the previous snapshot together
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return f"{type(exc).__name__}: {exc}"
        return "" if loaded else f"torchtitan did not load {path}"

    def set_aside(self, path: Path) -> None:
        DiskTier.set_aside(self, path)  # type: ignore[arg-type] - uses nothing of the tier

    def save(self, step: int, build: Callable[[], Any], staged: Callable[[DiskWrite], None]) -> DiskWrite:
        """Collective: torchtitan's checkpoint of this step, now (or the one its own policy just began)."""
        m = self.manager
        path = Path(m._create_checkpoint_id(step))
        t0 = time.perf_counter()
        if m.saved_by_policy == step:  # torchtitan's interval fell on this step: that save serves the request
            upload = m.save_future if m.save_future is not None else _done()
        else:
            m.maybe_wait_for_saving()
            result = m.dcp_save(m._flattened_model_states_sd(), checkpoint_id=str(path), async_mode=m.async_mode)
            if result is None:  # synchronous: written
                upload = _done()
            else:
                if hasattr(result, "staging_completion"):  # pinned memory: the live state may change after staging
                    result.staging_completion.result()
                    result = result.upload_completion
                upload = result
                m.save_future = upload  # torchtitan's next save waits for it, as for its own
        write = DiskWrite(step, path, upload, t0, time.perf_counter() - t0, 0)
        staged(write)
        return write

    def finish(self, write: DiskWrite, **marker: Any) -> str:
        try:
            write.upload.result()
        except BaseException as exc:  # noqa: BLE001 - a failed checkpoint is reported, never loaded (no .metadata)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return f"{type(exc).__name__}: {exc}"
        if self.manager.save_future is write.upload:
            self.manager.save_future = None
        self.manager._purge_stale_checkpoints()  # torchtitan's retention (keep_latest_k), rank 0
        return ""

    def close(self) -> None:
        """Nothing of its own: the manager closes its threads."""


class SentinelCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` that also serves Sentinel's daemon (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        migrate_hold_seconds: float = DEFAULT_MIGRATE_HOLD_SECONDS
        """After a migrate checkpoint, hold at least this long for the drain (the daemon may ask longer)."""

        exit_on_drain: bool = True
        """A rank drained during the hold exits 75 at once (torchrun restarts the group on the spare)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.saved_by_policy: int | None = None
        self.guard: SnapshotGuard | None = None
        self.exit_on_drain = config.exit_on_drain
        if not self.enable:
            return
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        self.record = ProgressRecord.from_env(rank=rank, world=dist.get_world_size() if dist.is_initialized() else 1)
        self._reported = 0
        self.guard = SnapshotGuard(self.folder, self.states, migrate_hold_seconds=config.migrate_hold_seconds,
                                   disk=TitanTier(self, rank))

    def _load(self, step: int = -1) -> bool:
        if step != -1 or self.guard is None:  # an explicit --checkpoint.load_step: torchtitan's own
            return super()._load(step)
        self.guard.resume()  # rank 0 picks; every rank loads through TitanTier -> CheckpointManager._load
        if self.guard.resumed_from:
            return True
        return super()._load(-1)  # nothing of this run's: torchtitan's first start (initial_load_path, HF)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        self.saved_by_policy = curr_step if saved and not last_step else None
        if self.guard is not None:
            step_or_leave(self.guard, curr_step, self.record, self._report, self.exit_on_drain)
        return saved

    def _report(self) -> None:
        """Rank 0: one progress line per checkpoint the guard finished (where the job has a progress file)."""
        self._reported = report_snapshots(self.guard, self.record, self._reported)

    def _close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        super()._close()


__all__ = ["SentinelCheckpointManager", "TitanTier"]
