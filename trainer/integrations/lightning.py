"""Sentinel for Lightning: one callback, nothing else changed in the user's script.

    from trainer.integrations.lightning import SentinelCallback

    trainer = L.Trainer(..., callbacks=[SentinelCallback("/shared/snapshots")])
    trainer.fit(model, datamodule)

Launched as any Lightning job under torchelastic (Lightning's ``TorchElasticEnvironment``):
``sentinel launch -- python -m trainer.elastic --preload lightning.pytorch -- --nnodes ... script.py``.

What it does
------------
* **After each optimizer step** (``on_train_batch_end`` when ``trainer.global_step`` moved: with
  gradient accumulation, only the batches that stepped) it calls :meth:`SnapshotGuard.step`
  with step ``global_step - 1``: the daemon's snapshot and migrate requests are served there,
  periodic snapshots (``interval_steps``) are taken there, and a migrate hold ends with this rank
  leaving (exit 75) so that torchrun restarts the workers onto the spare. The callback moves
  itself to the end of ``trainer.callbacks`` so its snapshot holds what every other callback
  (``ModelCheckpoint`` included) did at that step.
* **The snapshot is Lightning's whole checkpoint** (what ``Trainer.save_checkpoint`` writes:
  loops' progress, callbacks' state, LR schedulers, precision plugin, datamodule and the
  module's ``on_save_checkpoint`` extras, hyper-parameters), written with DCP: the model and the
  optimizers through ``torch.distributed.checkpoint.state_dict`` (DDP: one copy; FSDP2/DTensor:
  sharded, resharded on load), the rest as one object. Per rank: the RNG states (torch, CUDA,
  ``random``, numpy) and the position of a stateful data loader.
* **On (re)start** (``on_fit_start``: after the strategy built the optimizers, before Lightning
  restores its training state) the newest complete snapshot is loaded and handed to Lightning's
  own restore path, as if ``Trainer.fit(ckpt_path=...)`` had named it; at ``on_train_start`` a
  plain (not stateful) map-style ``DataLoader`` restarted in the middle of an epoch is moved
  forward past the batches already trained on (Lightning itself would replay the epoch from its
  first batch), then the RNG states are put back. The resumed run is then bitwise equal to an
  uninterrupted one at the same world size (deterministic data given).

Not covered (docs/integrations.md): an iterable dataset that is not stateful (its position
cannot be restored), a data loader whose samples draw from the global RNG in worker processes,
manual optimization with several optimizer steps per batch (the guard steps once per batch),
``Trainer(max_time=...)``'s clock.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainer.guard import SnapshotGuard
from trainer.integrations.guarded import report_snapshots, step_or_leave
from trainer.integrations.progress import ProgressRecord, write_final

try:
    import lightning.pytorch as pl
except ImportError:  # the pytorch-lightning distribution alone
    import pytorch_lightning as pl

log = logging.getLogger("sentinel.trainer")

_LOADER_KEYS = ("loops", "fit_loop", "state_dict", "combined_loader")


def _dumps(obj: Any) -> str:
    """One text value: DCP writes it as any object, the memory tier keeps it in a slot's JSON meta."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _loads(data: str) -> Any:
    # the job's own snapshot, read by the job's own user: what DCP does for any non-tensor value
    return torch.load(io.BytesIO(base64.b64decode(data)), weights_only=False)


def rng_states() -> dict[str, Any]:
    """This process's RNG states: torch (CPU and, once initialised, CUDA), ``random``, numpy."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(states["numpy"])


class LightningState(Stateful):
    """A running ``Trainer``'s whole checkpoint as one DCP Stateful.

    ``{"model", "optim"}``: torch's FQN-keyed state dicts of the LightningModule and all its
    optimizers (DCP saves replicated tensors once, DTensors as shards); ``"trainer"``: the rest of
    ``dump_checkpoint()`` as one object; ``"rank<N>"``: this rank's RNG states and stateful data
    loader position (every rank saves its own; a rank loads its own, when the snapshot has it)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._has_rank_entry = True  # whether the snapshot about to be loaded holds this rank's entry
        self.loaded: dict[str, Any] | None = None  # the Lightning checkpoint dict, once loaded
        self.loaded_rank: dict[str, Any] | None = None
        self.rng: dict[str, Any] | None = None  # the RNG states the next training step starts from

    @property
    def rank_key(self) -> str:
        return f"rank{self.trainer.global_rank}"

    def before_load(self, path: Path) -> None:
        """The template asks for this rank's entry only where the snapshot has one (another world size)."""
        from torch.distributed.checkpoint import FileSystemReader

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        self._has_rank_entry = any(k == f"lightning.{self.rank_key}" for k in saved)

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        model_sd, optim_sd = get_state_dict(trainer.lightning_module, trainer.optimizers)
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        ckpt.pop("state_dict", None)
        ckpt.pop("optimizer_states", None)
        loader = _pop_path(ckpt, _LOADER_KEYS)  # per rank: each rank's loader is at its own place
        out = {"model": model_sd, "optim": optim_sd, "trainer": _dumps(ckpt)}
        if self._has_rank_entry:
            out[self.rank_key] = _dumps({"rng": self.rng, "loader": loader})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self.trainer
        set_state_dict(trainer.lightning_module, trainer.optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        ckpt = _loads(state_dict["trainer"])
        mine = _loads(state_dict[self.rank_key]) if self._has_rank_entry else {}
        if mine.get("loader") is not None:
            _put_path(ckpt, _LOADER_KEYS, mine["loader"])
        # Lightning's own restore path reads these; they hold the state just loaded
        ckpt["state_dict"] = trainer.lightning_module.state_dict()
        ckpt["optimizer_states"] = [opt.state_dict() for opt in trainer.optimizers]
        self.loaded, self.loaded_rank = ckpt, mine
        self._has_rank_entry = True


def _pop_path(d: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for k in keys[:-1]:
        d = d.get(k) if isinstance(d, dict) else None
        if d is None:
            return None
    return d.pop(keys[-1], None) if isinstance(d, dict) else None


def _put_path(d: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def _epoch_ends_here(trainer: Any) -> bool:
    """Whether this step is the last of an epoch of several batches: no snapshot is taken there.

    Lightning resumes a checkpoint taken there (``on_train_batch_end`` of an epoch's last batch)
    by closing the epoch, but then counts the next epoch as already started: that epoch's
    ``on_train_epoch_start`` hooks never run and a checkpoint taken during it resumes at the
    wrong place (seen with Lightning 2.6.6: resumed twice, the run diverged). So a request that
    arrives at an epoch's last step is served at the next step, the next epoch's first, which
    Lightning resumes exactly. An epoch of one batch has no other step: it is snapshotted as is."""
    loop = trainer.fit_loop.epoch_loop
    return bool(loop.batch_progress.is_last_batch) and trainer.num_training_batches > 1


def _stateful_loader(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _set_epoch(loader: Any, epoch: int) -> None:
    """What Lightning does at each epoch's start (its samplers' ``set_epoch``), done early: the
    loader is moved forward before Lightning's own call."""
    for obj in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


class _SentinelHooks:
    """The callback's body, shared by ``lightning.pytorch`` and ``pytorch_lightning`` callbacks."""

    def __init__(self, snapshot_dir: str | os.PathLike, *, progress: str | os.PathLike | None = None,
                 exit_on_drain: bool = True, **guard_options: Any) -> None:
        super().__init__()
        self.snapshot_dir = Path(snapshot_dir)
        self.guard_options = {**options_from_env(), **guard_options}
        self.progress_path = progress
        self.exit_on_drain = exit_on_drain
        self.guard: SnapshotGuard | None = None
        self.state: LightningState | None = None
        self.start_step = 0
        self._last_global_step = -1
        self._reported = 0
        self.record = ProgressRecord(None)
        self._pad = float(os.environ.get(DRILL_STEP_ENV, "0") or 0)
        self._step_t0 = time.perf_counter()

    # -- start and resume -----------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        # last: the snapshot at a step holds what every other callback did at that step
        if trainer.callbacks and trainer.callbacks[-1] is not self:
            trainer.callbacks.remove(self)
            trainer.callbacks.append(self)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Collective: open the guard and load the newest complete snapshot into Lightning's restore path."""
        self.record = ProgressRecord.from_env(self.progress_path, rank=trainer.global_rank, world=trainer.world_size)
        self.record("admitted", process_started=_process_started())
        self.state = LightningState(trainer)
        self.guard = SnapshotGuard(self.snapshot_dir, {"lightning": self.state}, **self.guard_options)
        self.start_step = self.guard.resume()
        ckpt = self.state.loaded
        if ckpt is not None:
            conn = trainer._checkpoint_connector
            conn._loaded_checkpoint = ckpt  # what fit(ckpt_path=...) would have read; Lightning restores
            conn.restore_datamodule()  # the training state next (precision, loops, optimizers, schedulers)
            conn.restore_model()
            conn.restore_callbacks()
        self._last_global_step = -1
        self.record("resumed", start=self.start_step, source=str(self.guard.resumed_from or ""),
                    channel_error=self.guard.channel_error, restore=self.guard.restore_summary(),
                    skipped=[str(p) for p in self.guard.skipped_on_resume])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.state is None or self.state.loaded is None:
            return
        if trainer.global_step != self.start_step:
            raise RuntimeError(f"sentinel: the snapshot of step {self.start_step - 1} restored Lightning at "
                               f"global step {trainer.global_step}")
        self._move_plain_loaders(trainer)
        self.state.rng = (self.state.loaded_rank or {}).get("rng")
        if self.state.rng is None:
            log.warning("sentinel: the snapshot holds no RNG state for rank %d (another world size)",
                        trainer.global_rank)
        self.state.loaded = None  # release it; Lightning has its own copy until resume_end

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Every training step starts from the RNG states the previous one ended with: what runs
        between two steps (a validation loop, an epoch's new data loader iterator: each draws a
        seed from the global RNG) takes nothing from the steps' random stream, so a run resumed
        at any step, whatever Lightning re-runs or skips around it, draws what the uninterrupted
        run drew."""
        if self.state is not None and self.state.rng is not None:
            set_rng_states(self.state.rng)

    def _move_plain_loaders(self, trainer: Any) -> None:
        """Lightning restarts a plain loader at its epoch's first batch: skip what was trained on."""
        loop = trainer.fit_loop
        progress = loop.epoch_loop.batch_progress
        loader = loop._combined_loader
        if loader is None or not loop.restarted_mid_epoch:
            return
        loaders = loader.flattened
        if all(_stateful_loader(dl) for dl in loaders):
            return  # Lightning restored their position itself
        epoch = loop.epoch_progress.current.processed
        for dl in loaders:
            _set_epoch(dl, epoch)
        skip = progress.current.ready
        iterator = loop._data_fetcher.iterator
        for _ in range(skip):
            next(iterator)
        log.info("sentinel: data loader moved past the %d batch(es) of epoch %d trained on before the snapshot",
                 skip, epoch)

    # -- every optimizer step ---------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.state is not None:
            self.state.rng = rng_states()  # what the next batch starts from (on_train_batch_start)
        step = trainer.global_step - 1
        if self.guard is None or trainer.global_step == self._last_global_step or step < 0:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_global_step = trainer.global_step
        if trainer.global_rank == 0:
            self.record("step", step=step, loss=_loss(outputs))
        if _epoch_ends_here(trainer):
            return  # the guard steps at the next batch: see _epoch_ends_here
        step_or_leave(self.guard, step, self.record, self._report, self.exit_on_drain)
        if self._pad:  # drills only: a step as long as the drill's --step-seconds
            time.sleep(max(0.0, self._pad - (time.perf_counter() - self._step_t0)))
        self._step_t0 = time.perf_counter()

    def _report(self) -> None:
        self._reported = report_snapshots(self.guard, self.record, self._reported)

    # -- the end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is None:
            return
        self.guard.close()
        self._report()
        self.record("guard", **self.guard.summary())
        from trainer.train import state_digests

        digests = state_digests(trainer.lightning_module, trainer.optimizers)
        if trainer.global_rank == 0:
            write_final(digests, steps=trainer.global_step, world=trainer.world_size,
                        resumed_at=self.start_step, guard=self.guard.summary())
            self.record("finished", **digests)
        self.guard = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.close(flush=False)  # peers may be gone: nothing collective
            self.guard = None

    def state_dict(self) -> dict[str, Any]:
        return {}


ENV_OPTIONS = {"SENTINEL_INTERVAL_STEPS": ("interval_steps", int),
               "SENTINEL_MEMORY_INTERVAL_STEPS": ("memory_interval_steps", int),
               "SENTINEL_MIGRATE_HOLD_SECONDS": ("migrate_hold_seconds", float)}
DRILL_STEP_ENV = "SENTINEL_DRILL_STEP_SECONDS"


def options_from_env() -> dict[str, Any]:
    """Guard options an operator sets for a job without touching its script (the script's own
    keyword arguments win): ``SENTINEL_INTERVAL_STEPS`` (periodic disk snapshots),
    ``SENTINEL_MEMORY_INTERVAL_STEPS`` (the memory tier), ``SENTINEL_MIGRATE_HOLD_SECONDS``."""
    out: dict[str, Any] = {}
    for env, (name, kind) in ENV_OPTIONS.items():
        raw = os.environ.get(env, "").strip()
        if raw:
            try:
                out[name] = kind(raw)
            except ValueError:
                raise ValueError(f"{env}={raw!r} is not a number") from None
    return out


def _loss(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return round(float(loss.detach()), 6) if isinstance(loss, torch.Tensor) else None


def _process_started() -> float | None:
    """When this worker process started (trainer.train stamps it; a script may not have)."""
    main = sys.modules.get("__main__")
    return getattr(main, "PROCESS_STARTED", None)


class SentinelCallback(_SentinelHooks, pl.Callback):
    """``Trainer(callbacks=[SentinelCallback(snapshot_dir)])``: Sentinel's snapshots, migrations and
    resumes for a Lightning job (module docstring). ``guard_options`` go to :class:`SnapshotGuard`
    (``interval_steps``, ``keep``, ``migrate_hold_seconds``, ``async_save``...)."""


__all__ = ["SentinelCallback", "LightningState", "rng_states", "set_rng_states"]
