"""Where a node's memory holder is: its directory, who owns it, its id (pure: no torch).

``/dev/shm`` is world-writable, so any user can make any name there first. A holder is used only
when it is this user's own: a real directory (never a symlink), owned by the effective uid, that
nobody else can enter or write (0700). The name ``/dev/shm/sentinel-<uid>`` is the default; when
another user squatted it, :func:`default_holder_dir` picks a holder nobody else can claim (see
there), and the memory tier starts anyway.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from trainer.memory.slot import MemoryTierError

log = logging.getLogger("sentinel.trainer")
SUFFIX_HEX = 16  # the random part of a fallback holder's name


def _owned_dir(path: Path, uid: int) -> bool:
    """A real directory (not a link) owned by ``uid``."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def _private(path: Path, uid: int) -> bool:
    """Owned by ``uid`` and closed to everyone else."""
    return _owned_dir(path, uid) and not os.lstat(path).st_mode & 0o077


def _fallbacks(shm: Path, uid: int) -> list[Path]:
    """This user's ``sentinel-<uid>-<hex>`` holders under ``shm``, oldest name order (sorted):
    only those whose owner is verified; another user's look-alikes are ignored."""
    prefix = f"sentinel-{uid}-"
    try:
        names = sorted(n for n in os.listdir(shm) if n.startswith(prefix))
    except OSError:
        return []
    return [shm / n for n in names
            if len(n) == len(prefix) + SUFFIX_HEX and all(c in "0123456789abcdef" for c in n[len(prefix):])
            and _private(shm / n, uid)]


def default_holder_dir(*, shm: Path = Path("/dev/shm"), run_user: Path = Path("/run/user"),
                       uid: int | None = None, local_rank: int | None = None, wait_seconds: float = 30.0,
                       sleep: Callable[[float], None] = time.sleep) -> Path:
    """This user's holder on this node, one no other user can claim:

    1. ``SENTINEL_MEMORY_DIR`` when set;
    2. ``<shm>/sentinel-<uid>`` when it is absent (created 0700 now) or this user's own;
    3. when another user made that name first: ``<run_user>/<uid>/sentinel`` if logind's
       ``/run/user/<uid>`` is this user's and private;
    4. else ``<shm>/sentinel-<uid>-<16 hex>``: the first existing one this user owns (a
       restarted rank finds its copies), or a new one with a random name that local rank 0
       (``LOCAL_RANK``, torchrun's) creates while the node's other ranks wait up to
       ``wait_seconds`` for it, so all of them pick the same.

    ``/dev/shm`` is tried before ``/run/user`` because logind caps the latter (10 % of memory by
    default), often below what the slots need. The result still goes through :func:`ensure_holder`.
    Raises MemoryTierError when no holder can be had."""
    env = os.environ.get("SENTINEL_MEMORY_DIR")
    if env:
        return Path(env)
    uid = os.geteuid() if uid is None else uid
    first = shm / f"sentinel-{uid}"
    try:
        os.mkdir(first, 0o700)
    except OSError:
        pass  # there already (checked next), or no such tmpfs (ensure_holder says so)
    if not os.path.lexists(first) or _owned_dir(first, uid):
        return first
    try:
        owner = os.lstat(first).st_uid
    except OSError:
        owner = -1
    log.error("memory holder %s belongs to uid %d, not %d (squatted); using another holder", first, owner, uid)
    if _private(run_user / str(uid), uid):
        return run_user / str(uid) / "sentinel"
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    found = _fallbacks(shm, uid)
    if not found and local_rank == 0:
        new = shm / f"sentinel-{uid}-{secrets.token_hex(SUFFIX_HEX // 2)}"
        try:
            os.mkdir(new, 0o700)
            os.chmod(new, 0o700)  # whatever the umask
        except OSError as exc:
            raise MemoryTierError(f"cannot create the memory holder {new}: {exc.strerror}") from None
        found = _fallbacks(shm, uid)
    end = time.monotonic() + wait_seconds
    while not found and time.monotonic() < end:
        sleep(0.05)
        found = _fallbacks(shm, uid)
    if not found:
        raise MemoryTierError(f"memory holder {first} belongs to uid {owner} (squatted), {run_user / str(uid)} is not "
                              f"this user's, and local rank 0 made no {shm}/sentinel-{uid}-<hex> within "
                              f"{wait_seconds:.0f} s; set SENTINEL_MEMORY_DIR")
    return found[0]


def ensure_holder(path: Path) -> Path:
    """Create the holder directory (0700) or check an existing one: ours, a real directory, not
    writable by anyone else. /dev/shm is world-writable: another user may have planted the name."""
    path = Path(os.path.abspath(path))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise MemoryTierError(f"cannot create the memory holder {path}: {exc.strerror}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise MemoryTierError(f"memory holder {path} is not a directory (a symlink?); remove it or set SENTINEL_MEMORY_DIR")
    if st.st_uid != os.geteuid():
        raise MemoryTierError(f"memory holder {path} is owned by uid {st.st_uid}, not {os.geteuid()}; "
                              f"remove it or set SENTINEL_MEMORY_DIR")
    if st.st_mode & 0o077:
        raise MemoryTierError(f"memory holder {path} is open to others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"fix: chmod 700 {path}")
    return path


def holder_id(path: Path) -> str:
    """A stable id of one node's holder: its random id file (created once)."""
    idfile = path / "holder-id"
    if not os.path.lexists(idfile):
        # Every rank of the node gets here at once: the id is written to a private temporary file
        # and linked into place (atomic, fails if present), so no rank ever reads a half-written id.
        tmp = path / f".holder-id.{os.getpid()}.{threading.get_native_id()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(12).hex())
        try:
            os.link(tmp, idfile)
        except FileExistsError:
            pass  # another rank of this node was first: its id is the node's
        finally:
            os.unlink(tmp)
    fd = os.open(idfile, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        text = f.read(64).strip()
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise MemoryTierError(f"{idfile} is not a holder id; remove it")
    return text
