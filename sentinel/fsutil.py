"""Files a root daemon writes and the directories it trusts: one place for both.

* :func:`write_atomic` — the only way Sentinel replaces a file: a new file created with
  ``O_EXCL|O_NOFOLLOW`` next to the target, written, fsynced, renamed over the target, and the
  directory fsynced. A reader sees the old file or the new one, never half of one, and a crash
  never leaves a file that claims more than was written. ``rename`` replaces a planted symlink
  itself; it never writes through it.
* :func:`check_private_dir` — sshd-``StrictModes``-style: a directory the daemon acts on must be
  owned by root (or the daemon's own uid) and writable by nobody else, and so must every
  directory above it unless that one is root-owned and sticky (``/tmp``), where nobody else can
  rename or replace an entry.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any


class UnsafePath(RuntimeError):
    """A path the daemon must not trust; the message names it and the fix."""


def write_atomic(path: Path | str, data: bytes | str, *, mode: int = 0o644, fsync: bool = True) -> None:
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(path.parent)


def write_json_atomic(path: Path | str, data: Any, *, mode: int = 0o644, fsync: bool = True) -> None:
    write_atomic(path, json.dumps(data, separators=(",", ":"), default=str), mode=mode, fsync=fsync)


def fsync_dir(directory: Path | str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_trusted(path: Path | str, flags: int = os.O_RDONLY, *, mode: int = 0o600,
                 owners: frozenset[int] = frozenset({0}), single_link: bool = False) -> int:
    """Open ``path`` without following a symlink and return the descriptor, only if it is a
    regular file owned by one of ``owners`` and writable by nobody else (with ``single_link``,
    also not a hard link to another file). Raises FileNotFoundError when absent (and ``flags``
    has no O_CREAT) and UnsafePath when it must not be trusted."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        if st.st_uid not in owners:
            raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by {'/'.join(map(str, sorted(owners)))}")
        if st.st_mode & 0o022:
            raise UnsafePath(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
        if single_link and st.st_nlink != 1:
            raise UnsafePath(f"{path} has other links")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_trusted(path: Path | str, *, owners: frozenset[int] = frozenset({0}), max_bytes: int = 65536) -> bytes:
    """Read a small regular file that must be owned by one of ``owners`` (:func:`open_trusted`)."""
    fd = open_trusted(path, owners=owners)
    try:
        return os.read(fd, max_bytes + 1)[:max_bytes]
    finally:
        os.close(fd)


def check_private_dir(path: Path | str, what: str, *, owners: frozenset[int] | None = None) -> None:
    """Raise UnsafePath unless ``path`` and every directory above it are safe for root to act in."""
    owners = owners if owners is not None else frozenset({0, os.geteuid()})
    path = Path(os.path.abspath(path))
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{what} {path} is a symlink; point the config at the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{what} {path} is not a directory")
    if st.st_uid not in owners:
        raise UnsafePath(f"{what} {path} is owned by uid {st.st_uid}, not root; fix: chown root {path}")
    if st.st_mode & 0o022:
        raise UnsafePath(f"{what} {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"fix: chmod go-w {path}")
    for parent in path.parents:
        pst = os.stat(parent)
        if pst.st_uid not in owners:
            raise UnsafePath(f"{what} {path}: its parent {parent} is owned by uid {pst.st_uid}, not root")
        if pst.st_mode & 0o022 and not (pst.st_mode & stat.S_ISVTX and pst.st_uid == 0):
            raise UnsafePath(f"{what} {path}: its parent {parent} is writable by others and not sticky "
                             f"(mode {stat.S_IMODE(pst.st_mode):04o}); fix: chmod go-w {parent}")


def ensure_private_dir(path: Path | str, what: str, *, mode: int = 0o755) -> Path:
    """Create ``path`` (and parents) if missing, then :func:`check_private_dir` it."""
    path = Path(path)
    if not os.path.lexists(path):
        old = os.umask(0o022)
        try:
            path.mkdir(parents=True, exist_ok=True, mode=mode)
        finally:
            os.umask(old)
    check_private_dir(path, what)
    return path


def probe_writable(directory: Path | str) -> None:
    """Create and remove a file in ``directory`` (O_EXCL|O_NOFOLLOW, a random name); raises OSError."""
    name = Path(directory) / f".write-test.{secrets.token_hex(6)}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"x")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(name)
