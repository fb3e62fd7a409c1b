"""A node's holder: one directory on a tmpfs, and the mapped slot files in it.

Each node keeps one directory on a tmpfs (``/dev/shm/sentinel-<uid>`` by default): files survive a
worker's death, torchrun's restarts and the exit of every process, and vanish with the node (or a
reboot). Per rank: ``own-<shard>-<slot>.mem`` (3 slots: the newest agreed snapshot, one being
persisted to disk, one being written) and ``replica-<shard>-<slot>.mem`` (2 slots: the newest
complete replica survives a torn one). Files are created once, ``posix_fallocate``d (a full tmpfs
is an error at start, never a SIGBUS mid-copy) and mapped; the mapping *is* the staging buffer, so
a snapshot allocates nothing. The bytes of a slot follow :mod:`trainer.memory.slot`.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.memory.place import default_holder_dir, ensure_holder, holder_id  # noqa: F401 - the old names
from trainer.memory.slot import (
    COMPLETE, EMPTY, FIXED, FIXED_LEN, MAGIC, VERSION, WRITING, MemoryBudgetError, MemoryTierError, SlotInfo,
    data_offset, parse_header, parse_name,
)

if TYPE_CHECKING:
    from trainer.memory.layout import Layout


# madvise(MADV_POPULATE_WRITE) (Linux 5.14; Python < 3.12 has no name for it): map every page of a
# slot at setup, so the first snapshots into it do not pay a page fault per 4 KiB.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Slot:
    """One mapped slot file. The mapping is the buffer: staging copies straight into it."""

    def __init__(self, path: Path, data_len: int, *, create: bool = True) -> None:
        self.path = path
        self.data_len = data_len
        self.offset = data_offset()
        size = self.offset + max(data_len, 1)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
                raise MemoryTierError(f"{path} is not a private regular file of uid {os.geteuid()}; remove it")
            if st.st_size != size:
                os.ftruncate(fd, 0)  # a slot of another size (another layout): start it over
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.ftruncate(fd, 0)
                    if exc.errno in (errno.ENOSPC, errno.EFBIG):
                        raise MemoryBudgetError(f"{path.parent} is full: cannot reserve {size / 2**20:.1f} MiB "
                                                f"for {path.name}") from None
                    raise
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        _populate(self.mm, self.buf)
        self.data = self.buf[self.offset:self.offset + data_len]
        self._views: list[torch.Tensor] | None = None
        self._views_of: str = ""

    def views(self, layout: Layout) -> list[torch.Tensor]:
        if self._views is None or self._views_of != layout.hash:
            self._views, self._views_of = layout.views(self.data), layout.hash
        return self._views

    def header(self) -> tuple[int, int, int | None, dict]:
        """(state, step, crc or None, meta) — state EMPTY for anything unreadable."""
        return parse_header(self.mm[:self.offset])[0:4]

    def begin(self, step: int) -> None:
        self.mm[:FIXED_LEN] = FIXED.pack(MAGIC, VERSION, WRITING, step, self.offset, self.data_len, 0, 0, 0).ljust(FIXED_LEN, b"\0")

    def finish(self, step: int, meta: dict, crc: int | None) -> None:
        raw = json.dumps(meta, separators=(",", ":")).encode()
        if len(raw) > self.offset - FIXED_LEN:
            raise MemoryTierError(f"the snapshot's non-tensor state ({len(raw)} bytes) does not fit the slot header")
        self.mm[FIXED_LEN:FIXED_LEN + len(raw)] = raw
        head = FIXED.pack(MAGIC, VERSION, WRITING, step, self.offset, self.data_len, crc or 0, crc is not None, len(raw))
        self.mm[:FIXED_LEN] = head.ljust(FIXED_LEN, b"\0")
        # the state word last: a reader that sees COMPLETE sees everything before it
        self.mm[12:16] = struct.pack("<I", COMPLETE)

    def invalidate(self) -> None:
        self.mm[8:16] = struct.pack("<II", VERSION, EMPTY)

    def meta_bytes(self) -> bytes:
        fixed = FIXED.unpack(self.mm[:FIXED.size])
        return bytes(self.mm[FIXED_LEN:FIXED_LEN + fixed[8]])

    def crc(self) -> int:
        return zlib.crc32(memoryview(self.mm)[self.offset:self.offset + self.data_len])

    def close(self) -> None:
        self._views = None
        self.data = self.buf = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process


def _populate(mm: mmap.mmap, buf: torch.Tensor) -> None:
    """Map every page of a slot now (its content unchanged): a snapshot into a fresh mapping
    would otherwise take a page fault per 4 KiB, about 3x a warm copy (measured on tmpfs)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
    except (OSError, ValueError):  # kernel < 5.14: a read of one byte per page maps it as well (shmem)
        if buf.numel():
            buf[::mmap.PAGESIZE].sum()



def inventory(path: Path, *, run: str, world: int) -> tuple[list[SlotInfo], dict[str, int]]:
    """The loadable slots in a holder, and counts of what was rejected and why (torn: WRITING;
    stale: another run id or world size; unreadable)."""
    found, rejected = [], {"torn": 0, "stale_run": 0, "other_world": 0, "unreadable": 0}
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return [], rejected
    for name in names:
        parsed = parse_name(name)
        if parsed is None:
            continue
        role, shard, slot = parsed
        try:
            fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    rejected["unreadable"] += 1
                    continue
                raw = os.pread(fd, data_offset(), 0)
            finally:
                os.close(fd)
        except OSError:
            rejected["unreadable"] += 1
            continue
        state, step, crc, meta, data_len = parse_header(raw)
        if state == WRITING:
            rejected["torn"] += 1
        elif state != COMPLETE:
            continue
        elif meta.get("run") != run:
            rejected["stale_run"] += 1
        elif meta.get("world") != world or meta.get("shard") != shard:
            rejected["other_world"] += 1
        else:
            found.append(SlotInfo(name, role, shard, slot, state, step, data_len, crc, meta))
    return found, rejected

