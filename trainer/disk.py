"""The disk tier: DCP snapshots in one directory shared by every rank, committed by a marker.

Contract
--------
* A snapshot is the directory ``step-<9 digits>``; it is *complete* once its commit marker
  ``COMMITTED`` exists. Rank 0 writes the marker (atomically: a temporary file, fsync, rename)
  once the save completed on every rank (DCP writes its metadata only after gathering every
  rank's writes); a snapshot interrupted halfway has no marker and is never loaded.
* Fenced by generation (:mod:`trainer.fence`, with the slot rendezvous): the marker records the
  writer's generation, and a commit by an older generation than the newest that resumed from the
  directory is refused before anything is written: a cut-off rank 0 never commits, so its
  snapshot is never loaded.
* Retention: after each commit, the newest ``keep`` complete snapshots stay; older complete ones
  and abandoned partial ones older than the newest are removed.
* Before a save into a step directory, rank 0 removes a marker left there (a failed save, or a
  corrupt one that could not be moved aside): it must not vouch for what is written now. Rank 0
  is in the save's first collective, so no rank writes before this unlink.
* Private, whatever the umask: a step directory is created 0700 by the first rank to reach
  :meth:`DiskTier._begin` (before any rank's DCP call can create it), so nothing in it is ever
  reachable by another user; rank 0 makes every file in it 0600 before the marker (itself 0600)
  commits it. A snapshot directory Sentinel creates is 0700 too (an existing one is left as the
  operator made it). Like the memory tier's holder.
* A snapshot that failed to load is renamed aside (``step-000000123.corrupt-<unix time>``), so a
  later save at the same step never inherits its marker. Kept, not deleted: someone may want to
  know why.
* One write at a time. :meth:`DiskTier.save` writes the live state with ``dcp.async_save`` (the
  caller is blocked only while the state is staged to host memory) or ``dcp.save``;
  :meth:`DiskTier.save_copy` writes a state that is already a copy (a memory-tier slot) on a
  background thread. Both run on the checkpoint process group, used by nothing else meanwhile.

Who decides when to save, and which snapshot every rank loads, is the caller's business
(:class:`trainer.guard.SnapshotGuard`): this module only reads and writes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.fence import DirectoryFence, FencedWriteRefused
from trainer.memory.slot import MemoryTierError

log = logging.getLogger("sentinel.trainer")

MARKER = "COMMITTED"
PREFIX = "step-"
CORRUPT = ".corrupt-"


def _mkdir_private(path: Path, *, parents: bool = False) -> None:
    """Create ``path`` 0700 whatever the umask; an existing one is left as it is, except that a
    step directory this user owns is made 0700 (a failed save's, from before this rule)."""
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if parents:
            return
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _private_files(path: Path) -> None:
    """Every regular file under ``path`` 0600 (links are never followed; other users' files are
    left alone, they cannot be in a 0700 directory of ours)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o600:
                os.chmod(full, 0o600)


def snapshot_path(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step:09d}"


def _step_of(name: str) -> int | None:
    """The step of a snapshot directory name; None for anything else (``*.corrupt-*`` included)."""
    if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    return None


def complete_snapshots(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of snapshots with a commit marker, newest first. Snapshots renamed aside as
    corrupt are not listed."""
    out = []
    directory = Path(directory)
    if not directory.is_dir():
        return out
    for p in directory.iterdir():
        step = _step_of(p.name)
        if step is not None and (p / MARKER).is_file():
            out.append((step, p))
    return sorted(out, reverse=True)


def staged_bytes(state_dict: Any) -> int:
    """Approximate size of a state dict: the sum of its (local) tensors' bytes."""
    if isinstance(state_dict, Mapping):
        return sum(staged_bytes(v) for v in state_dict.values())
    if isinstance(state_dict, (list, tuple)):
        return sum(staged_bytes(v) for v in state_dict)
    if isinstance(state_dict, torch.Tensor):
        local = state_dict.to_local() if hasattr(state_dict, "to_local") else state_dict
        return local.numel() * local.element_size()
    return 0


@dataclass
class DiskWrite:
    """One snapshot being written. ``upload`` completes once this rank's part is written;
    ``blocked``: how long the caller was held (staging); ``started``: a ``perf_counter`` value."""

    step: int
    path: Path
    upload: Future
    started: float
    blocked: float = 0.0
    bytes: int = 0

    def done(self) -> bool:
        return self.upload.done()


class DiskTier:
    """One rank's side of the disk tier. :meth:`save`, :meth:`save_copy` and :meth:`load` are
    collective on ``group``; :meth:`finish`, :meth:`set_aside` and :meth:`read_part` are not."""

    def __init__(self, directory: str | os.PathLike, *, group: Any, rank: int, world: int, keep: int = 3,
                 async_save: bool = True, generation: tuple[str, int] | None = None) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.directory = Path(directory)
        self.fence = DirectoryFence(self.directory, generation)  # (epoch, generation); None: not fenced
        self.group = group
        self.rank, self.world = rank, world
        self.keep = keep
        self.async_save = async_save
        self._stager = None
        self._pool: ThreadPoolExecutor | None = None
        if self.rank == 0:
            _mkdir_private(self.directory, parents=True)
            # before rank 0 lists what to load: from now on an older generation's commit is refused
            self.fence.raise_to()

    # -- reading ----------------------------------------------------------------------------------
    def snapshots(self) -> list[tuple[int, Path]]:
        """The complete snapshots, newest first (what this rank sees of the directory)."""
        return complete_snapshots(self.directory)

    def load(self, state: Mapping[str, Any], path: Path) -> str:
        """Collective: load ``path`` into ``state``. The error ("" when it loaded on this rank).

        A value with a ``before_load(path)`` method is told which snapshot is about to be read
        before DCP asks it for its state dict (the template it loads into): an integration whose
        state holds entries only some ranks saved (per-rank RNG, a data loader's position) asks
        for exactly what that snapshot has."""
        try:
            for value in state.values():
                before = getattr(value, "before_load", None)
                if callable(before):
                    before(path)
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
        except (CheckpointException, Exception) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            return f"{type(exc).__name__}: {exc}"
        return ""

    @staticmethod
    def read_part(path: Path, state: dict[str, Any]) -> None:
        """Not collective: read this rank's part of the disk snapshot ``path`` into ``state`` (the
        live state dict; DTensors take only their local shard). The memory tier calls it on the one
        rank whose shard lost every memory copy, while the others restore from memory; the step is
        the same, so the result is what a collective load of the whole snapshot gives."""
        import warnings

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(state, checkpoint_id=str(path), no_dist=True)
            except CheckpointException as exc:  # a BaseException: as an Exception, every rank goes to disk together
                raise MemoryTierError(f"cannot read this rank's part of {path}: {str(exc)[:300]}") from None

    def set_aside(self, path: Path) -> None:
        """Rename a snapshot that failed to load, so its marker can never vouch for a later save
        into the same step directory. Kept, not deleted: someone may want to know why."""
        aside = path.with_name(f"{path.name}{CORRUPT}{int(time.time())}")
        for n in range(1, 100):
            if not aside.exists():
                break
            aside = path.with_name(f"{path.name}{CORRUPT}{int(time.time())}-{n}")
        try:
            os.rename(path, aside)
            log.warning("moved the unloadable snapshot %s aside to %s", path, aside.name)
        except OSError as exc:
            # The save into this directory removes the stale marker first (see _begin).
            log.error("could not move the unloadable snapshot %s aside: %s", path, exc)

    # -- writing ----------------------------------------------------------------------------------
    def _begin(self, step: int) -> Path:
        path = snapshot_path(self.directory, step)
        # Every rank, before its own save: whoever comes first creates the directory 0700, so DCP
        # (which creates it with the umask's mode) never does, and no file of it is ever exposed.
        _mkdir_private(path)
        if self.rank == 0:
            # A directory left at this step (a failed save, or a corrupt one that could not be
            # moved aside) must not keep vouching for what is written now. Rank 0 is in the save's
            # first collective, so no rank writes before this unlink. Fenced: a cut-off rank 0 must
            # not unlink the marker of what a newer generation committed at this step.
            with self.fence.commit():
                (path / MARKER).unlink(missing_ok=True)
        return path

    def save(self, step: int, build: Callable[[], Mapping[str, Any]], staged: Callable[[DiskWrite], None]
             ) -> DiskWrite:
        """Collective: save the state ``build()`` returns (the live state) at ``step``. Returns once
        it is staged (async) or written (not async); ``staged(write)`` is called as soon as the
        write has begun: after staging (async), before writing (not async)."""
        path = self._begin(step)
        t0 = time.perf_counter()
        state_dict = build()
        write = DiskWrite(step, path, Future(), t0, 0.0, staged_bytes(state_dict))
        if self.async_save:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self._stager is None:
                cuda = torch.cuda.is_available()
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda))
            resp = dcp.async_save(state_dict, checkpoint_id=str(path), process_group=self.group,
                                  async_stager=self._stager)
            if hasattr(resp, "staging_completion"):
                resp.staging_completion.result()  # state may change at the next step: wait for the copy
                write.upload = resp.upload_completion
            else:
                write.upload = resp
            write.blocked = time.perf_counter() - t0
            staged(write)
        else:
            staged(write)  # the write begins now
            try:
                dcp.save(state_dict, checkpoint_id=str(path), process_group=self.group)
                write.upload.set_result(None)
            except (CheckpointException, Exception) as exc:  # noqa: BLE001 - recorded and acknowledged as a failure
                write.upload.set_exception(exc)
            write.blocked = time.perf_counter() - t0
        return write

    def save_copy(self, step: int, build: Callable[[], Any], nbytes: int) -> DiskWrite:
        """Collective: save ``build()``, a copy of the state that stays unchanged until the write
        completes (a memory-tier slot), at ``step`` on a background thread; returns at once."""
        path = self._begin(step)
        t0 = time.perf_counter()
        to_save = build()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sentinel-disk")
        write = DiskWrite(step, path, Future(), t0, 0.0, nbytes)
        write.upload = self._pool.submit(dcp.save, to_save, checkpoint_id=str(path), process_group=self.group)
        write.blocked = time.perf_counter() - t0
        return write

    def finish(self, write: DiskWrite, **marker: Any) -> str:
        """Wait for ``write``; when it succeeded, rank 0 commits it (the marker, holding ``marker``'s
        items too, then retention). The error, "" when it is committed (or, on other ranks, written)."""
        try:
            write.upload.result()
        except (CheckpointException, Exception) as exc:  # noqa: BLE001 - a failed snapshot is reported, never committed
            error = f"{type(exc).__name__}: {exc}"
            log.error("snapshot at step %d failed: %s", write.step, error)
            return error
        if self.rank == 0:
            try:
                self._commit(write, marker)
            except FencedWriteRefused as exc:
                log.error("snapshot at step %d not committed: %s", write.step, exc)
                return f"commit refused (fenced): {exc}"
            except OSError as exc:
                return f"commit failed: {exc}"
        return ""

    def _commit(self, write: DiskWrite, extra: Mapping[str, Any]) -> None:
        marker = {"step": write.step, "world_size": self.world, "time": time.time(), "blocked_seconds": write.blocked,
                  **extra}
        if self.fence.token is not None:
            marker["epoch"], marker["generation"] = self.fence.token
        with self.fence.commit():  # refused, nothing written, once a newer generation resumed here
            _private_files(write.path)
            tmp = write.path / f".{MARKER}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o600)  # whatever the umask
                f.write(json.dumps(marker))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, write.path / MARKER)
            self._retain(write.step)

    def _retain(self, newest: int) -> None:
        complete = complete_snapshots(self.directory)
        for _, path in complete[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        kept = {p for _, p in complete[: self.keep]}
        for p in self.directory.iterdir():
            step = _step_of(p.name)
            if step is not None and p not in kept and step < newest:  # abandoned partial snapshots
                shutil.rmtree(p, ignore_errors=True)

    def close(self) -> None:
        """Stop the background writer (after the write in flight) and the stager."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()
