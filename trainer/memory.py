"""The memory tier: every rank's shard in node-local memory that outlives the worker, plus one
replica on another node.

Placement
---------
Rank ``r`` on node ``n`` (``n = r // L``, ``L`` ranks per node, torchrun's order) sends its shard
to the rank with the same local rank on node ``(n + 1) mod N`` and holds the shard of the same
local rank on node ``(n - 1) mod N``: a ring of nodes. Any single node can die and every shard
survives (its own copy or its replica); two *adjacent* nodes dying loses the shards of the first
one, and recovery falls back to the newest disk snapshot. (With ``N = 2`` the two nodes hold each
other's replicas.) NVIDIA's resiliency extension calls the same idea a clique with
``replication_jump = L`` and ``replication_factor = 2``; DLRover's flash checkpoint pairs nodes;
Gemini places replicas in groups of nodes. See README "Memory tier".

Holder
------
Each node keeps one directory on a tmpfs (``/dev/shm/sentinel-<uid>`` by default): files survive a
worker's death, torchrun's restarts and the exit of every process, and vanish with the node (or a
reboot). Per rank: ``own-<shard>-<slot>.mem`` (3 slots: the newest agreed snapshot, one being
persisted to disk, one being written) and ``replica-<shard>-<slot>.mem`` (2 slots: the newest
complete replica survives a torn one). Files are created once, ``posix_fallocate``d (a full tmpfs
is an error at start, never a SIGBUS mid-copy) and mapped; the mapping *is* the staging buffer, so
a snapshot allocates nothing.

Slot format: a 64-byte fixed header (magic, version, state, step, data offset, data length, CRC32,
meta length), a JSON meta block (run id, world size, shard, layout hash, the non-tensor leaves of
the state), then the tensor bytes at a 4 KiB-aligned offset. A writer marks the slot WRITING
before touching the data and COMPLETE (with the step) only after; a slot found WRITING — its
writer died mid-copy, or a replica's sender died mid-transfer — is never loaded. A replica is
COMPLETE only once the bytes received match the sender's CRC32. A slot of another run id, world
size or layout is stale and never loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import mmap
import os
import queue
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

log = logging.getLogger("sentinel.trainer")

MAGIC = b"SNTLMEM1"
VERSION = 1
EMPTY, WRITING, COMPLETE = 0, 1, 2
_FIXED = struct.Struct("<8sIIqQQIII")  # magic version state step data_offset data_len crc has_crc meta_len
FIXED_LEN = 64
ALIGN = 4096
OWN_SLOTS = 3
REPLICA_SLOTS = 2
META_ROOM = 64 * 1024  # room for the JSON meta: the non-tensor leaves change between snapshots
CHUNK = 16 << 20  # replica and restore transfers go in chunks of this size (throttled, and yielding, per chunk)
# madvise(MADV_POPULATE_WRITE) (Linux 5.14; Python < 3.12 has no name for it): map every page of a
# slot at setup, so the first snapshots into it do not pay a page fault per 4 KiB.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
OWN, REPLICA = "own", "replica"


class MemoryTierError(RuntimeError):
    """The memory tier cannot be used as configured; the message says why and what to change."""


class MemoryBudgetError(MemoryTierError):
    """Not enough room in a node's holder for its shards and its partner's replica."""


# -- layout: the state dict as a list of tensors at fixed offsets ---------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _walk(obj: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    if isinstance(obj, Mapping):
        for k in obj:
            yield from _walk(obj[k], path + (k,))
    elif isinstance(obj, (list, tuple)) and not _is_leaf_seq(obj):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))
    else:
        yield path, obj


def _is_leaf_seq(obj: Any) -> bool:
    """A list or tuple holding no tensor and no mapping is one value (betas, param name lists)."""
    return not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in obj)


def _encode(v: Any) -> Any:
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    raise MemoryTierError(f"the memory tier cannot hold a state value of type {type(v).__name__}: {v!r}")


def _decode(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"__tuple__"}:
        return tuple(_decode(x) for x in v["__tuple__"])
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def _path_key(path: tuple) -> str:
    return json.dumps(list(path))


@dataclass(frozen=True)
class Leaf:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Layout:
    """Where each tensor of one rank's state lives in a slot's data region. Built from the live
    state dict; two layouts with one hash hold the same tensors (names, dtypes, local shapes)."""

    leaves: list[Leaf]
    value_keys: list[str]
    data_len: int
    hash: str

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> "Layout":
        leaves, values, offset = [], [], 0
        h = hashlib.sha256()
        for path, v in _walk(state):
            key = _path_key(path)
            if isinstance(v, torch.Tensor):
                t = _local(v)
                n = t.numel() * t.element_size()
                leaves.append(Leaf(key, t.dtype, tuple(t.shape), offset, n))
                h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
                offset += (n + 63) // 64 * 64  # 64-byte aligned: a view of any dtype is legal
            else:
                values.append(key)
                h.update(f"{key}|value\n".encode())
        return cls(leaves, values, offset, h.hexdigest()[:32])

    def matches(self, state: Mapping[str, Any]) -> bool:
        return Layout.of(state).hash == self.hash

    def values(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {_path_key(p): _encode(v) for p, v in _walk(state) if not isinstance(v, torch.Tensor)}

    def views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each leaf in a uint8 data region (created once per slot, reused)."""
        return [data[lf.offset:lf.offset + lf.nbytes].view(lf.dtype).view(lf.shape) for lf in self.leaves]

    def stage(self, state: Mapping[str, Any], views: list[torch.Tensor]) -> None:
        i = 0
        for _, v in _walk(state):
            if isinstance(v, torch.Tensor):
                views[i].copy_(_local(v).detach())
                i += 1

    def restore_into(self, state: Mapping[str, Any], views: list[torch.Tensor], values: Mapping[str, Any]) -> None:
        """Copy a slot's tensors into the live state's tensors and set its non-tensor leaves."""
        i = 0
        for path, v in _walk(state):
            if isinstance(v, torch.Tensor):
                with torch.no_grad():
                    _local(v).copy_(views[i])
                i += 1
            else:
                key = _path_key(path)
                if key in values:
                    _set(state, path, _decode(values[key]))

    def rebuild(self, template: Mapping[str, Any], tensors: list[Any], values: Mapping[str, Any]) -> Any:
        """A state dict shaped like ``template`` whose tensors are ``tensors`` (in leaf order) and
        whose other leaves come from ``values``: what the disk tier saves from a slot."""
        it = iter(tensors)

        def build(obj: Any, path: tuple) -> Any:
            if isinstance(obj, Mapping):
                return {k: build(obj[k], path + (k,)) for k in obj}
            if isinstance(obj, (list, tuple)) and not _is_leaf_seq(obj):
                return type(obj)(build(v, path + (i,)) for i, v in enumerate(obj))
            if isinstance(obj, torch.Tensor):
                return next(it)
            key = _path_key(path)
            return _decode(values[key]) if key in values else obj

        return build(template, ())


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _copy_all(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """views[i] <- sources[i]: one copy per tensor, in one call where torch has it."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(views, sources)
    else:
        for dst, src in zip(views, sources):
            dst.copy_(src)


def _set(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    if isinstance(obj, tuple):
        return  # immutable container: the live value stays (it is a leaf sequence in practice)
    obj[path[-1]] = value


# -- slots ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlotInfo:
    """One slot's header as found in a holder (what the inventory reports)."""

    file: str
    role: str
    shard: int
    slot: int
    state: int
    step: int
    data_len: int
    crc: int | None
    meta: dict

    @property
    def run(self) -> str:
        return str(self.meta.get("run", ""))


def slot_name(role: str, shard: int, slot: int) -> str:
    return f"{role}-{shard:05d}-{slot}.mem"


def parse_name(name: str) -> tuple[str, int, int] | None:
    if not name.endswith(".mem"):
        return None
    parts = name[:-4].split("-")
    if len(parts) != 3 or parts[0] not in (OWN, REPLICA) or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def data_offset(meta_room: int = META_ROOM) -> int:
    return (FIXED_LEN + meta_room + ALIGN - 1) // ALIGN * ALIGN


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
        return _parse_header(self.mm[:self.offset])[0:4]

    def begin(self, step: int) -> None:
        self.mm[:FIXED_LEN] = _FIXED.pack(MAGIC, VERSION, WRITING, step, self.offset, self.data_len, 0, 0, 0).ljust(FIXED_LEN, b"\0")

    def finish(self, step: int, meta: dict, crc: int | None) -> None:
        raw = json.dumps(meta, separators=(",", ":")).encode()
        if len(raw) > self.offset - FIXED_LEN:
            raise MemoryTierError(f"the snapshot's non-tensor state ({len(raw)} bytes) does not fit the slot header")
        self.mm[FIXED_LEN:FIXED_LEN + len(raw)] = raw
        head = _FIXED.pack(MAGIC, VERSION, WRITING, step, self.offset, self.data_len, crc or 0, crc is not None, len(raw))
        self.mm[:FIXED_LEN] = head.ljust(FIXED_LEN, b"\0")
        # the state word last: a reader that sees COMPLETE sees everything before it
        self.mm[12:16] = struct.pack("<I", COMPLETE)

    def invalidate(self) -> None:
        self.mm[8:16] = struct.pack("<II", VERSION, EMPTY)

    def meta_bytes(self) -> bytes:
        fixed = _FIXED.unpack(self.mm[:_FIXED.size])
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


def _parse_header(raw: bytes) -> tuple[int, int, int | None, dict, int]:
    if len(raw) < FIXED_LEN:
        return EMPTY, -1, None, {}, 0
    magic, version, state, step, offset, data_len, crc, has_crc, meta_len = _FIXED.unpack(raw[:_FIXED.size])
    if magic != MAGIC or version != VERSION or state not in (EMPTY, WRITING, COMPLETE) or meta_len > len(raw) - FIXED_LEN:
        return EMPTY, -1, None, {}, 0
    meta: dict = {}
    if state == COMPLETE:
        try:
            meta = json.loads(raw[FIXED_LEN:FIXED_LEN + meta_len])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return EMPTY, -1, None, {}, 0
        if not isinstance(meta, dict):
            return EMPTY, -1, None, {}, 0
    return state, step, (crc if has_crc else None), meta, data_len


# -- the holder -------------------------------------------------------------------------------------
def default_holder_dir() -> Path:
    env = os.environ.get("SENTINEL_MEMORY_DIR")
    return Path(env) if env else Path("/dev/shm") / f"sentinel-{os.geteuid()}"


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
        state, step, crc, meta, data_len = _parse_header(raw)
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


# -- restore planning (pure) --------------------------------------------------------------------------
DISK = -1  # RestorePlan.senders: the shard's own rank reads it from the disk snapshot of the same step


@dataclass
class RestorePlan:
    """Which copy each shard is restored from, at one step every shard has."""

    step: int
    # shard -> (holder id, file, data_len, crc): the copy chosen ("" holder: the disk snapshot)
    sources: dict[int, tuple[str, str, int, int | None]]
    # shard -> the rank that sends it (None: the shard's own rank reads it from its node's memory;
    # DISK: the shard's own rank reads its part of the disk snapshot of this step, alone)
    senders: dict[int, int | None]
    local: list[int] = field(default_factory=list)
    peer: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)


def plan_restore(world: int, holders: list[str], found: Mapping[str, list[SlotInfo]],
                 layouts: list[str] | None = None, disk_step: int | None = None) -> tuple[RestorePlan | None, str]:
    """The newest step every shard ``0..world-1`` can be restored from, and from where.

    ``holders[r]`` is the holder id of rank ``r``'s node now; ``found[h]`` the loadable slots in
    holder ``h``; ``layouts[r]`` rank ``r``'s layout hash (a copy of another layout is unusable).
    A shard's copy in its own rank's holder is preferred; otherwise the lowest rank on the holder
    with a copy sends it. ``disk_step``: the step of the newest complete disk snapshot, if its
    shards can be read one rank at a time: at that step a shard whose every memory copy was lost
    (two adjacent nodes failed together) is read from disk by its own rank while the others come
    from memory — unless no shard at all would come from memory. Returns (None, why) when no step
    has every shard."""
    by_step: dict[int, dict[int, list[tuple[str, SlotInfo]]]] = {}
    for h, infos in found.items():
        for info in infos:
            if layouts is not None and info.meta.get("layout") != layouts[info.shard]:
                continue
            by_step.setdefault(info.step, {}).setdefault(info.shard, []).append((h, info))
    if not by_step:
        return None, "no memory snapshot of this run"
    in_job = set(holders)
    missing_newest = ""
    for step in sorted(by_step, reverse=True):
        copies = {r: [hc for hc in c if hc[0] in in_job] for r, c in by_step[step].items()}
        missing = [r for r in range(world) if not copies.get(r)]
        mixed = step == disk_step and len(missing) < world
        if missing and not mixed:
            if not missing_newest:
                lost = [r for r in missing if r not in by_step[step]]
                missing_newest = (f"no copy of shard(s) {lost[:8]} at step {step} (own and replica both lost)" if lost
                                  else f"the copies of shard(s) {missing[:8]} at step {step} are on nodes that left the job")
            continue
        plan = RestorePlan(step, {}, {})
        for r in range(world):
            if r in missing:
                plan.sources[r], plan.senders[r] = ("", "", 0, None), DISK
                plan.disk.append(r)
                continue
            options = sorted(copies[r], key=lambda hc: (hc[0] != holders[r], hc[1].role != OWN, hc[0], hc[1].file))
            h, info = options[0]
            plan.sources[r] = (h, info.file, info.data_len, info.crc)
            if h == holders[r]:
                plan.senders[r] = None
                plan.local.append(r)
            else:
                on_h = [q for q in range(world) if holders[q] == h]
                plan.senders[r] = on_h[r % len(on_h)]
                plan.peer.append(r)
        return plan, ""
    return None, missing_newest  # every step was skipped, the first one saying why


def ring_partners(rank: int, world: int, local_world: int) -> tuple[int, int]:
    """(send to, receive from): same local rank on the next / previous node."""
    nodes = max(1, world // local_world)
    node, local = divmod(rank, local_world)
    return ((node + 1) % nodes) * local_world + local, ((node - 1) % nodes) * local_world + local


# -- the replicator ---------------------------------------------------------------------------------
@dataclass
class _Job:
    step: int
    slot: "Slot"
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str = ""


class Replicator:
    """One background thread: copies each staged own slot to the partner and receives the
    partner's into a replica slot, then agrees with every rank (an all-reduce) that the step is
    complete everywhere. Runs on a process group of its own; nothing else uses it while it runs."""

    def __init__(self, group: Any, send_to: int, recv_from: int, replica_slots: list["Slot"],
                 *, bytes_per_second: float = 0.0, timeout: float = 120.0) -> None:
        self.group = group
        self.send_to, self.recv_from = send_to, recv_from
        self.replicas = replica_slots
        self.bytes_per_second = bytes_per_second
        self.timeout = timeout
        self.agreed_step = -1
        self.agreed_slot: Slot | None = None
        self.replica_newest: Slot | None = None
        self.errors = 0
        self.last_error = ""
        self.copied_bytes = 0
        self.seconds: list[float] = []
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._current: _Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sentinel-replica", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        with self._lock:
            return self._current is not None or not self._jobs.empty()

    def slots_in_use(self) -> list["Slot"]:
        """The own slots this thread is reading or will read (the one being copied, those queued)."""
        with self._lock, self._jobs.mutex:
            queued = list(self._jobs.queue)
            return [j.slot for j in ([self._current] if self._current is not None else []) + queued if j is not None]

    def submit(self, step: int, slot: "Slot") -> _Job:
        job = _Job(step, slot)
        with self._lock:
            self._current = job if self._current is None else self._current
            self._jobs.put(job)
        return job

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        # Not niced: measured here at nice 10 a copy took 2-3x longer (snapshots late) and the step
        # gained nothing; while it waits for a core, it may also hold the interpreter lock the
        # training thread needs.
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._current = job
            t0 = time.perf_counter()
            try:
                job.ok = self._replicate(job)
            except Exception as exc:  # noqa: BLE001 - a dead peer (gloo error) or a torn copy: counted, never loaded
                job.ok, job.error = False, f"{type(exc).__name__}: {exc}"
            if not job.ok:
                self.errors += 1
                self.last_error = job.error
                log.warning("memory snapshot at step %d not replicated: %s", job.step, job.error)
            self.seconds.append(time.perf_counter() - t0)
            with self._lock:
                self._current = None
            job.done.set()

    def _replicate(self, job: _Job) -> bool:
        """Send the staged own slot to the partner and receive the partner's into a replica slot,
        then agree with every rank. Few round trips, each with little Python between them: the
        head (step, length, CRC32, meta) and the first chunk go in one batch, then the other
        chunks, then one all-reduce. This thread shares the interpreter with the training loop,
        so every wake-up here can delay it; the work itself is in gloo and zlib, without the GIL."""
        own = job.slot
        ok = True
        if self.send_to != _rank():  # a single node: nobody to copy to
            crc = own.crc()
            meta = own.meta_bytes()
            head_out = _pack_head(job.step, own.data_len, crc, meta)
            head_in = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
            target = next((s for s in self.replicas if s is not self.replica_newest), self.replicas[0])
            target.begin(-1)  # WRITING (step unknown until the head arrives): never loaded if torn
            n_out, n_in = own.data_len, target.data_len
            first = min(CHUNK, max(n_out, n_in))
            t0 = time.perf_counter()
            self._exchange([(head_out, head_in), (own.data[:min(first, n_out)], target.data[:min(first, n_in)])])
            self._throttle(min(first, n_out), time.perf_counter() - t0)
            step_in, len_in, crc_in, meta_len_in, meta_in = _unpack_head(head_in)
            if len(meta_in) < meta_len_in or len(meta) > HEAD_BYTES - _HEAD.size:  # a long meta: one more exchange
                extra_in = torch.zeros(meta_len_in - len(meta_in), dtype=torch.uint8)
                extra_out = (torch.frombuffer(bytearray(meta[HEAD_BYTES - _HEAD.size:]), dtype=torch.uint8)
                             if len(meta) > HEAD_BYTES - _HEAD.size else torch.zeros(0, dtype=torch.uint8))
                self._exchange([(extra_out, extra_in)])
                meta_in += extra_in.numpy().tobytes()
            if len_in != n_in:
                raise MemoryTierError(f"rank {self.recv_from}'s shard is {len_in} bytes, its replica slot {n_in}: "
                                      "the layout changed")
            self._pair_data(own.data, target.data, n_out, n_in, start=first)
            got = target.crc()
            if got != crc_in:
                job.error = f"replica of step {step_in} from rank {self.recv_from} is torn (CRC {got:08x} != {crc_in:08x})"
                ok = False
            else:
                meta_obj = json.loads(meta_in)
                meta_obj["role"] = REPLICA
                target.finish(step_in, meta_obj, crc_in)
                self.replica_newest = target
            self.copied_bytes += own.data_len
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        if _collective(2):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if int(flag.item()) == 1:
            self.agreed_step, self.agreed_slot = job.step, own
            return True
        if ok:
            job.error = "another rank's replica failed"
        return False

    def _exchange(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Post every (send to the partner, receive from the other partner) at once; wait for all."""
        works = []
        for out, into in pairs:
            if into.numel():
                works.append(dist.irecv(into, src=self.recv_from, group=self.group))
            if out.numel():
                works.append(dist.isend(out, dst=self.send_to, group=self.group))
        for w in works:
            w.wait()

    def _pair_data(self, out: torch.Tensor, into: torch.Tensor, n_out: int, n_in: int, *, start: int = 0) -> None:
        """The data from ``start`` on, in chunks of :data:`CHUNK` (throttled per chunk)."""
        for begin in range(start, max(n_out, n_in), CHUNK):
            t0 = time.perf_counter()
            o = out[begin:min(n_out, begin + CHUNK)] if begin < n_out else out[:0]
            i = into[begin:min(n_in, begin + CHUNK)] if begin < n_in else into[:0]
            self._exchange([(o, i)])
            self._throttle(o.numel(), time.perf_counter() - t0)

    def _throttle(self, nbytes: int, took: float) -> None:
        if self.bytes_per_second > 0 and nbytes:
            pause = nbytes / self.bytes_per_second - took
            if pause > 0:
                time.sleep(pause)


# The replica head: step, data length, CRC32, meta length, then as much of the meta as fits.
_HEAD = struct.Struct("<qqqq")
HEAD_BYTES = 4096


def _pack_head(step: int, data_len: int, crc: int, meta: bytes) -> torch.Tensor:
    raw = _HEAD.pack(step, data_len, crc, len(meta)) + meta[:HEAD_BYTES - _HEAD.size]
    buf = bytearray(HEAD_BYTES)
    buf[:len(raw)] = raw
    return torch.frombuffer(buf, dtype=torch.uint8)


def _unpack_head(head: torch.Tensor) -> tuple[int, int, int, int, bytes]:
    raw = head.numpy().tobytes()
    step, data_len, crc, meta_len = _HEAD.unpack_from(raw)
    if not 0 <= meta_len <= META_ROOM:
        raise MemoryTierError(f"a replica head with a meta of {meta_len} bytes")
    return step, data_len, crc, meta_len, raw[_HEAD.size:_HEAD.size + min(meta_len, HEAD_BYTES - _HEAD.size)]


def _rank() -> int:
    return dist.get_rank() if _collective(2) else 0


def _collective(world: int) -> bool:
    return world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# -- the tier -------------------------------------------------------------------------------------
@dataclass
class RestoreResult:
    """What a restore did, for logs, the progress file and the drill."""

    tier: str  # "memory", or "" when memory had nothing usable (the caller goes to disk)
    step: int = -1
    local: list[int] = field(default_factory=list)  # shards read from this node's memory
    peer: list[int] = field(default_factory=list)  # shards pulled from another node's copy
    disk: list[int] = field(default_factory=list)  # shards read from the disk snapshot of the same step
    reason: str = ""  # why memory was not used
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class MemoryTier:
    """One rank's side of the memory tier. Collective methods say so; every rank calls them in the
    same order. ``group`` is used by this tier only: by the replicator thread once started, and by
    :meth:`setup`/:meth:`restore` before that (on the training thread, with no thread running)."""

    def __init__(self, directory: str | os.PathLike, *, run_id: str, rank: int, world: int, local_world: int,
                 group: Any, bytes_per_second: float = 0.0, timeout: float = 120.0,
                 metrics_file: str | os.PathLike | None = None) -> None:
        if local_world < 1 or world % local_world:
            raise MemoryTierError(f"world size {world} is not a whole number of nodes of {local_world} ranks")
        self.dir = ensure_holder(Path(directory))
        self.holder = holder_id(self.dir)
        self.run, self.rank, self.world, self.local_world = run_id, rank, world, local_world
        self.nodes = world // local_world
        self.send_to, self.recv_from = ring_partners(rank, world, local_world)
        self.group = group
        self.bytes_per_second = bytes_per_second
        self.timeout = timeout
        self.metrics_file = Path(metrics_file) if metrics_file else self.dir / f"metrics-rank{rank}.prom"
        self.layout: Layout | None = None
        self.own: list[Slot] = []
        self.replicas: list[Slot] = []
        self.replicator: Replicator | None = None
        self.pinned: Slot | None = None
        self.holders: list[str] = []
        self.snapshots = 0  # memory snapshots handed to the replicator
        self.late = 0  # memory snapshots skipped: a replica copy was still running
        self.disk_only = 0  # steps staged for the disk tier alone (due while a replica copy ran)
        self.stalls: list[float] = []
        # where the stall goes, per snapshot: building the state dict (the caller), choosing the
        # slot and (re)building the copy plan, the tensor copies, the header and meta
        self.stall_parts: dict[str, list[float]] = {"build": [], "plan": [], "copy": [], "meta": []}
        self._plan: tuple[Any, list[torch.Tensor], list[tuple[str, tuple]]] | None = None
        self.held_bytes = 0
        self._cleanup_after_first = False
        self._disk_cache: dict[int, list[Any]] = {}
        if self.nodes == 1:
            log.warning("memory tier on a single node: no peer replica (a node loss falls back to disk)")

    # -- setup ------------------------------------------------------------------------------------
    def need_bytes(self, data_len: int, replica_len: int) -> int:
        off = data_offset()
        return OWN_SLOTS * (off + data_len) + (REPLICA_SLOTS * (off + replica_len) if self.nodes > 1 else 0)

    def setup(self, state: Mapping[str, Any]) -> None:
        """Collective. Lay out the state, check every node's holder has room for its ranks' own
        slots and replica slots (all ranks raise :class:`MemoryBudgetError` together, naming the
        node's holder and the size needed), then create and map the slots and start the replicator."""
        layout = Layout.of(state)
        reusable = sum(self._existing(slot_name(OWN, self.rank, i)) for i in range(OWN_SLOTS))
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        mine = (self.holder, str(self.dir), layout.data_len, free, reusable)
        everyone = self._gather(mine)
        self.holders = [e[0] for e in everyone]
        replica_len = everyone[self.recv_from][2]
        for r, e in enumerate(everyone):  # every rank judges every holder: one verdict everywhere
            everyone[r] = (*e, everyone[ring_partners(r, self.world, self.local_world)[1]][2])
        short = []
        for h in dict.fromkeys(self.holders):
            on_h = [e for e in everyone if e[0] == h]
            need = sum(self.need_bytes(e[2], e[5]) for e in on_h)
            have = on_h[0][3] + sum(e[4] for e in on_h)
            if need > have:
                short.append(f"{on_h[0][1]} (node of rank(s) {[r for r in range(self.world) if self.holders[r] == h]}) "
                             f"needs {need / 2**20:.1f} MiB, has {have / 2**20:.1f} MiB free")
        if short:
            raise MemoryBudgetError("memory tier: not enough memory for the in-memory snapshots ("
                                    f"{OWN_SLOTS} own slots + {REPLICA_SLOTS} replica slots per rank): "
                                    + "; ".join(short) + ". Grow /dev/shm (mount -o remount,size=...), point "
                                    "SENTINEL_MEMORY_DIR at a bigger tmpfs, or turn the memory tier off "
                                    "(memory_interval_steps=0)")
        self.layout = layout
        self.own = [self._open(OWN, self.rank, i, layout.data_len) for i in range(OWN_SLOTS)]
        if self.nodes > 1:
            self.replicas = [self._open(REPLICA, self.recv_from, i, replica_len) for i in range(REPLICA_SLOTS)]
        self.held_bytes = sum(s.offset + s.data_len for s in self.own + self.replicas)
        self.replicator = Replicator(self.group, self.send_to, self.recv_from, self.replicas,
                                     bytes_per_second=self.bytes_per_second, timeout=self.timeout)
        self._write_metrics()

    def _existing(self, name: str) -> int:
        try:
            st = os.lstat(self.dir / name)
        except OSError:
            return 0
        return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else 0

    def _open(self, role: str, shard: int, i: int, data_len: int) -> Slot:
        slot = Slot(self.dir / slot_name(role, shard, i), data_len)
        state, _, _, meta = slot.header()
        if state != EMPTY and meta.get("run") != self.run:
            slot.invalidate()  # stale memory of another run: never again taken for this one
        return slot

    def _gather(self, obj: Any) -> list[Any]:
        if not _collective(self.world):
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _write_metrics(self) -> None:
        """``sentinel_trainer_memory_snapshot_bytes`` in the Prometheus text format, for a
        node_exporter textfile collector (written atomically; this rank's slots only)."""
        own = sum(s.offset + s.data_len for s in self.own)
        rep = sum(s.offset + s.data_len for s in self.replicas)
        text = ("# HELP sentinel_trainer_memory_snapshot_bytes Host memory held by the in-memory snapshot tier\n"
                "# TYPE sentinel_trainer_memory_snapshot_bytes gauge\n"
                f'sentinel_trainer_memory_snapshot_bytes{{rank="{self.rank}",copy="own"}} {own}\n'
                f'sentinel_trainer_memory_snapshot_bytes{{rank="{self.rank}",copy="replica"}} {rep}\n')
        tmp = self.metrics_file.with_name(f".{self.metrics_file.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.metrics_file)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.metrics_file, exc)

    # -- snapshots ----------------------------------------------------------------------------------
    def busy(self) -> bool:
        return self.replicator is not None and self.replicator.busy()

    def snapshot(self, step: int, state: Mapping[str, Any], *, reuse: bool = False, build_seconds: float = 0.0) -> _Job:
        """Stage this rank's state at ``step`` into a free own slot (the stall) and hand it to
        the replicator. Call only when no rank is busy (the guard agrees on that first).

        ``reuse``: ``state`` is the same object as at the previous snapshot and its tensors are
        still the live ones (the caller checked); the list of tensors to copy is then reused
        instead of walking the state again. ``build_seconds``: what building ``state`` took the
        caller (counted in the stall)."""
        assert self.replicator is not None
        slot = self.stage(step, state, reuse=reuse, build_seconds=build_seconds)
        self.snapshots += 1
        return self.replicator.submit(step, slot)

    def stage(self, step: int, state: Mapping[str, Any], *, reuse: bool = False, build_seconds: float = 0.0) -> Slot:
        """Copy the state into a free own slot (not the agreed one, not the one the disk tier
        reads, not one the replicator reads) and mark it COMPLETE at ``step``; not replicated.
        One copy per tensor, straight from the live tensor into the slot's mapping."""
        assert self.layout is not None and self.replicator is not None
        t0 = time.perf_counter()
        in_use = self.replicator.slots_in_use()
        slot = next((s for s in self.own if s is not self.replicator.agreed_slot and s is not self.pinned
                     and all(s is not u for u in in_use)), None)
        if slot is None:  # the guard never stages with all three taken; say so rather than overwrite one
            raise MemoryTierError("no free memory slot: the agreed copy, the disk write and the replica copy "
                                  "hold all three")
        if not (reuse and self._plan is not None and self._plan[0] is state):
            self._plan = (state, *self._plan_of(state))
        _, sources, value_paths = self._plan
        views = slot.views(self.layout)
        t1 = time.perf_counter()
        slot.begin(step)
        _copy_all(views, sources)
        t2 = time.perf_counter()
        values = {key: _encode(_get(state, path)) for key, path in value_paths}
        slot.finish(step, {"run": self.run, "world": self.world, "shard": self.rank, "role": OWN,
                           "layout": self.layout.hash, "values": values, "time": time.time()}, None)
        t3 = time.perf_counter()
        self.stalls.append(build_seconds + t3 - t0)
        self.stall_parts["build"].append(build_seconds)
        self.stall_parts["plan"].append(t1 - t0)
        self.stall_parts["copy"].append(t2 - t1)
        self.stall_parts["meta"].append(t3 - t2)
        return slot

    def _plan_of(self, state: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[tuple[str, tuple]]]:
        """The live tensors to copy (local shards, in leaf order) and the paths of the other leaves,
        checked against the layout fixed at the first snapshot."""
        assert self.layout is not None
        sources, value_paths = [], []
        leaves = self.layout.leaves
        for path, v in _walk(state):
            if isinstance(v, torch.Tensor):
                t = _local(v).detach()
                i = len(sources)
                if i >= len(leaves) or tuple(t.shape) != leaves[i].shape or t.dtype != leaves[i].dtype:
                    raise MemoryTierError("the state's tensors changed shape or number after the first memory "
                                          "snapshot; the memory tier needs a fixed layout")
                sources.append(t)
            else:
                value_paths.append((_path_key(path), path))
        if len(sources) != len(leaves):
            raise MemoryTierError("the state's tensors changed shape or number after the first memory "
                                  "snapshot; the memory tier needs a fixed layout")
        return sources, value_paths

    def wait_idle(self) -> bool:
        return self.replicator is None or self.replicator.wait_idle(self.timeout)

    @property
    def agreed_step(self) -> int:
        return self.replicator.agreed_step if self.replicator is not None else -1

    def after_agreed(self) -> None:
        """Once a snapshot is agreed after a restore, drop copies this node no longer needs."""
        if not self._cleanup_after_first or self.agreed_step < 0:
            return
        self._cleanup_after_first = False
        keep = {s.path.name for s in self.own + self.replicas}
        local_ranks = [r for r in range(self.world) if self.holders and self.holders[r] == self.holder]
        if local_ranks and local_ranks[0] != self.rank:
            return  # one rank per node cleans
        for r in local_ranks:
            keep |= {slot_name(OWN, r, i) for i in range(OWN_SLOTS)}
            keep |= {slot_name(REPLICA, ring_partners(r, self.world, self.local_world)[1], i) for i in range(REPLICA_SLOTS)}
        for name in os.listdir(self.dir):
            if parse_name(name) is not None and name not in keep:
                try:
                    os.unlink(self.dir / name)
                except OSError as exc:
                    log.warning("cannot remove the stale memory copy %s: %s", name, exc)

    def disk_state(self, slot: Slot, template: Mapping[str, Any]) -> Any:
        """The state of ``slot`` shaped like ``template`` (the live state dict), with DTensor
        wrappers around the slot's bytes where the live state has DTensors: what DCP saves,
        reshardable like a save of the live state, without another copy."""
        assert self.layout is not None
        key = id(slot)
        if key not in self._disk_cache:
            views = slot.views(self.layout)
            live = [v for _, v in _walk(template) if isinstance(v, torch.Tensor)]
            wrapped = []
            for view, v in zip(views, live):
                if hasattr(v, "to_local"):
                    from torch.distributed.tensor import DTensor

                    wrapped.append(DTensor.from_local(view, v.device_mesh, v.placements, run_check=False,
                                                      shape=v.shape, stride=v.stride()))
                else:
                    wrapped.append(view)
            self._disk_cache[key] = wrapped
        _, _, _, meta = slot.header()
        return self.layout.rebuild(template, self._disk_cache[key], meta.get("values", {}))

    # -- restore ------------------------------------------------------------------------------------
    def restore(self, get_state, disk_step: int, read_disk: Callable[[Mapping[str, Any]], None] | None = None
                ) -> RestoreResult:
        """Collective. Find the newest step every shard of this run can be restored from memory
        (own node first, else the replica on a peer), load it into the live state and return what
        was done; ``tier == ""`` (with the reason) when memory has nothing as new as the newest
        disk snapshot ``disk_step`` (-1: none), or a copy failed to load on any rank — the caller
        then loads from disk. ``get_state()`` returns the live state dict (only called when
        memory will be used). ``read_disk(state)``, when given, reads this rank's part of the disk
        snapshot of ``disk_step`` into ``state`` without collectives: a shard whose every memory
        copy was lost (its node and the node holding its replica both failed) is then read from
        disk by its own rank alone while every other shard still comes from memory."""
        t0 = time.perf_counter()
        found, rejected = inventory(self.dir, run=self.run, world=self.world)
        for what, n in rejected.items():
            if n:
                log.warning("memory holder %s: %d %s cop%s ignored", self.dir, n, what.replace("_", " "),
                            "y" if n == 1 else "ies")
        everyone = self._gather((self.holder, found, rejected))
        self.holders = [e[0] for e in everyone]
        by_holder = {e[0]: e[1] for e in everyone}
        total_rejected: dict[str, int] = {}
        for h in dict.fromkeys(self.holders):
            for k, n in next(e[2] for e in everyone if e[0] == h).items():
                total_rejected[k] = total_rejected.get(k, 0) + n
        mixed_step = disk_step if read_disk is not None and disk_step >= 0 else None
        plan, why = plan_restore(self.world, self.holders, by_holder, disk_step=mixed_step)
        result = RestoreResult("", rejected=total_rejected)
        if plan is None or plan.step < disk_step:
            result.reason = why if plan is None else f"memory's newest complete step {plan.step} is older than disk's {disk_step}"
            return result
        state = get_state()
        layout = Layout.of(state)
        layouts = self._gather(layout.hash)
        plan, why = plan_restore(self.world, self.holders, by_holder, layouts, disk_step=mixed_step)
        if plan is None or plan.step < disk_step:
            result.reason = (why if plan is None else f"memory's newest complete step {plan.step} is older than disk's "
                             f"{disk_step}") + " (after matching layouts)"
            return result
        self.layout = layout
        self._plan = None  # the live tensors are about to be loaded into (or replaced)
        error = ""
        values: dict = {}
        try:
            values = self._execute(plan, layout, state, read_disk)
        except Exception as exc:  # noqa: BLE001 - any failure: every rank goes to disk together
            error = f"{type(exc).__name__}: {exc}"
            log.error("restore from memory at step %d failed on rank %d: %s", plan.step, self.rank, error)
        flag = torch.tensor([0 if error else 1], dtype=torch.int32)
        if _collective(self.world):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not int(flag.item()):
            result.reason = error or "the restore from memory failed on another rank"
            return result
        self._cleanup_after_first = True
        result.tier, result.step, result.local, result.peer = "memory", plan.step, plan.local, plan.peer
        result.disk = plan.disk
        result.seconds = time.perf_counter() - t0
        return result

    def _execute(self, plan: RestorePlan, layout: Layout, state: Mapping[str, Any],
                 read_disk: Callable[[Mapping[str, Any]], None] | None = None) -> dict:
        """Read or receive this rank's shard, send the shards this rank's node holds for others."""
        works, keep = [], []
        for shard, sender in sorted(plan.senders.items()):
            if sender != self.rank:
                continue
            _, name, data_len, _ = plan.sources[shard]
            src = Slot(self.dir / name, data_len, create=False)
            keep.append(src)
            state_, step, _, meta = src.header()
            if state_ != COMPLETE or step != plan.step:
                raise MemoryTierError(f"{name} changed while being sent")
            raw = json.dumps(meta).encode()
            head = torch.tensor([len(raw)], dtype=torch.int64)
            keep += [head, torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
            works.append(dist.isend(head, dst=shard, group=self.group))
            works.append(dist.isend(keep[-1], dst=shard, group=self.group))
            for start in range(0, data_len, CHUNK):
                works.append(dist.isend(src.data[start:start + CHUNK], dst=shard, group=self.group))
        values: dict = {}
        try:
            _, name, data_len, crc = plan.sources[self.rank]
            sender = plan.senders[self.rank]
            if sender != DISK and data_len != layout.data_len:
                raise MemoryTierError(f"the memory copy {name} holds {data_len} bytes, this rank's state {layout.data_len}")
            if sender == DISK:
                if read_disk is None:
                    raise MemoryTierError(f"shard {self.rank} is to be read from disk, but no disk reader was given")
                read_disk(state)  # this rank's part of the disk snapshot of plan.step, while the sends above run
            elif sender is None:
                slot = Slot(self.dir / name, data_len, create=False)
                keep.append(slot)
                state_, step, crc, meta = slot.header()
                if state_ != COMPLETE or step != plan.step or meta.get("layout") != layout.hash:
                    raise MemoryTierError(f"{self.dir / name} is not the complete copy of step {plan.step} it was")
                if crc is not None and slot.crc() != crc:
                    raise MemoryTierError(f"{self.dir / name} is corrupt (CRC mismatch)")
                layout.restore_into(state, slot.views(layout), meta.get("values", {}))
            else:
                # received straight into an own slot: it is then this node's own copy of that step
                slot = self._open(OWN, self.rank, 0, layout.data_len)
                keep.append(slot)
                slot.begin(plan.step)
                head = torch.zeros(1, dtype=torch.int64)
                dist.recv(head, src=sender, group=self.group)
                raw = torch.zeros(int(head.item()), dtype=torch.uint8)
                dist.recv(raw, src=sender, group=self.group)
                for start in range(0, data_len, CHUNK):
                    dist.recv(slot.data[start:start + CHUNK], src=sender, group=self.group)
                meta = json.loads(raw.numpy().tobytes())
                if crc is not None and slot.crc() != crc:
                    raise MemoryTierError(f"shard {self.rank} received from rank {sender} is torn (CRC mismatch)")
                if meta.get("layout") != layout.hash or meta.get("run") != self.run:
                    raise MemoryTierError(f"shard {self.rank} received from rank {sender} is of another layout or run")
                meta["role"] = OWN
                slot.finish(plan.step, meta, crc)
                layout.restore_into(state, slot.views(layout), meta.get("values", {}))
                slot.close()
        finally:  # the sends complete whatever happened to this rank's own shard
            for w in works:
                w.wait()
            for s in keep:
                if isinstance(s, Slot):
                    s.close()
        return values

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.wait_idle(self.timeout)
            self.replicator.close()
        self._disk_cache.clear()
        self._plan = None
        for s in self.own + self.replicas:
            s.close()
