"""Fencing by generation: a node cut off from the job (a partition) must not write what the job's
newer generation reads, even while its processes live on and once its link comes back.

The token is the slot rendezvous's **generation** (:mod:`trainer.slot_rendezvous`): every
membership change commits a new one, and a node that was replaced is a member of an older one.
Two things check it:

* **The rendezvous store** — :func:`fenced_set`: write a key only while the store's ``latest``
  generation still holds the writer's. A store with a transaction of its own implements
  ``fenced_set(fence_key, token, key, value) -> bool`` itself (etcd v3: ``Txn(If:
  Compare(Value(fence_key) == token), Then: Put(key, value))``) and is used as is. A c10d TCPStore
  has no two-key transaction: there the compare (a ``compare_set`` of the fence key onto itself)
  comes before the write, so one write can land after a commit that came between the two. The
  protocol keeps that harmless: what is fenced this way is a key the newer generation's holder
  overwrites (the slot's heartbeat); arrivals and records are ``compare_set`` on keys of their own
  generation, and ``leave`` checks the slot's mark in the committed generation, which never changes.
* **The snapshot commit** — :class:`DirectoryFence`: the snapshot directory holds the newest
  generation that resumed from it (``GENERATION``, raised by each generation's rank 0 when its disk
  tier opens, before it lists the snapshots to load). Rank 0 commits a snapshot (writes its marker,
  which records its generation) under the same lock, only when no newer generation has raised the
  fence; an older generation's commit is refused (:class:`FencedWriteRefused`) and its marker never
  written, so it is never loaded. ``flock`` on the directory's lock file serialises the two: on a
  shared filesystem that needs coherent locks across hosts (NFSv4, Lustre with ``flock``).

The token reaches the workers in ``SENTINEL_RDZV_GENERATION`` = ``<epoch>/<generation>`` (set by
``trainer.elastic``'s agent for the slot rendezvous; the epoch names the job instance, so a job
started again on the same directory, whose generations count from 1 again, is told apart). Without it (torch's c10d/etcd-v2 rendezvous) nothing is fenced,
as before. No torch here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Mapping

log = logging.getLogger("sentinel.trainer")

ENV = "SENTINEL_RDZV_GENERATION"
FENCE_FILE = "GENERATION"
LOCK_FILE = ".GENERATION.lock"
MAX_GENERATION = 10**12


class FencedWriteRefused(RuntimeError):
    """A write by a member of an older generation than the job's newest: refused, nothing written."""


def fenced_set(store: Any, fence_key: str, token: str, key: str, value: str) -> bool:
    """Write ``key`` = ``value`` only while ``fence_key`` holds ``token`` (module docstring). True
    when written; False, nothing written, when the fence moved on. Raises the store's errors."""
    native = getattr(store, "fenced_set", None)
    if native is not None:
        return bool(native(fence_key, token, key, value))
    return compare_then_set(store, fence_key, token, key, value)


def compare_then_set(store: Any, fence_key: str, token: str, key: str, value: str) -> bool:
    """:func:`fenced_set` on a store with no transaction (a c10d TCPStore): the compare, then the write."""
    got = store.compare_set(fence_key, token, token)
    if (got.decode() if isinstance(got, bytes) else str(got)) != token:
        return False
    store.set(key, value)
    return True


def generation_from_env(environ: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """This worker's fencing token ``(epoch, generation)`` from ``SENTINEL_RDZV_GENERATION``
    (``<epoch>/<generation>``: the job instance, made by its first generation's commit, and the
    generation), or None when the agent set none. A malformed value is an error: fencing silently
    off would let a cut-off rank commit."""
    raw = environ.get(ENV, "")
    if raw == "":
        return None
    epoch, _, gen = raw.partition("/")
    if not (0 < len(epoch) <= 64 and epoch.isalnum() and gen.isdigit() and 0 < int(gen) < MAX_GENERATION):
        raise ValueError(f"{ENV}={raw!r}: not <epoch>/<generation>")
    return epoch, int(gen)


def token_env(epoch: str, generation: int) -> str:
    """The value of ``SENTINEL_RDZV_GENERATION`` for a worker of ``generation`` of job instance ``epoch``."""
    return f"{epoch}/{generation}"


def _ours(path: Path, st: os.stat_result) -> None:
    """The fence's files are this job's user's: in a directory others can write (shared scratch,
    sticky), a lock file or fence another user made first is refused, not waited on or believed."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise FencedWriteRefused(f"{path} is not a regular file of uid {os.geteuid()} (uid {st.st_uid} made it): "
                                 "not trusted as a fence; the snapshot directory must be writable by the job's user only")


class DirectoryFence:
    """The generation fence of one snapshot directory (module docstring). ``token`` is the writer's
    ``(epoch, generation)``; None: no fencing (every method does nothing). The fence file holds the
    newest token that resumed here: a later generation of the same epoch raises it; another epoch
    (the job was started again: requeued, relaunched) replaces it, and from then on every commit of
    the old epoch is refused too."""

    def __init__(self, directory: Path, token: tuple[str, int] | None) -> None:
        self.directory = Path(directory)
        self.token = token

    @property
    def generation(self) -> int | None:
        return None if self.token is None else self.token[1]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        path = self.directory / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _ours(path, os.fstat(fd))  # another user's lock file could be held by them for ever
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def current(self) -> tuple[str, int] | None:
        """The newest token that resumed from this directory (None: no fence file yet)."""
        path = self.directory / FENCE_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise FencedWriteRefused(f"{path} is a symlink: not trusted as a fence") from None
            raise
        with os.fdopen(fd) as f:
            _ours(path, os.fstat(fd))
            try:
                doc = json.loads(f.read(512))
                epoch, gen = doc["epoch"], doc["generation"]
            except (ValueError, TypeError, KeyError):
                epoch = gen = None
        if not isinstance(epoch, str) or not isinstance(gen, int) or isinstance(gen, bool) or not 0 < gen < MAX_GENERATION:
            raise FencedWriteRefused(f"{path} is not a generation fence")
        return epoch, gen

    def raise_to(self) -> tuple[str, int] | None:
        """Make this writer's token the directory's newest (a lower generation of the same epoch
        never lowers it): the fence every older writer's commit is checked against. The fence now."""
        if self.token is None:
            return None
        with self._locked():
            now = self.current()
            if now is None or now[0] != self.token[0] or self.token[1] > now[1]:
                tmp = self.directory / f".{FENCE_FILE}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({"epoch": self.token[0], "generation": self.token[1]}))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.directory / FENCE_FILE)
                now = self.token
            return now

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """Hold the fence while a snapshot is committed: raises :class:`FencedWriteRefused` (before
        anything is written) when a newer generation, or another instance of the job, resumed here."""
        if self.token is None:
            yield
            return
        with self._locked():
            now = self.current()
            if now is not None and (now[0] != self.token[0] or now[1] > self.token[1]):
                raise FencedWriteRefused(
                    f"generation {self.token[1]} may not commit: "
                    + (f"generation {now[1]} of this job" if now[0] == self.token[0] else "another instance of this job")
                    + f" has resumed from {self.directory} (this rank was cut off and replaced)")
            yield
