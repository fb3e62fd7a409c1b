"""The replicator: a background thread that copies each staged own slot to the ring partner and
receives the other partner's into a replica slot, then agrees with every rank that the step is
complete everywhere."""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainer.memory.slot import META_ROOM, REPLICA, MemoryTierError

if TYPE_CHECKING:
    from trainer.memory.holder import Slot

log = logging.getLogger("sentinel.trainer")

CHUNK = 16 << 20  # replica and restore transfers go in chunks of this size (throttled, and yielding, per chunk)


@dataclass
class Job:
    step: int
    slot: "Slot"
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str = ""


class Replicator:
    """One background thread: copies each staged own slot to the partner and receives the
    partner's into a replica slot. Runs on a process group of its own; nothing else uses it while
    it runs. A round ends with this rank's verdict (``done``: the newest step whose round
    succeeded here); the agreement that a step is complete on every rank is the training
    thread's: the guard's per-step all-reduce carries every rank's ``done`` step, and
    :meth:`agree` takes the least of them (no collective of this thread's own: measured here, the
    per-round all-reduce of four processes' background threads was most of the tier's cost)."""

    def __init__(self, group: Any, send_to: int, recv_from: int, replica_slots: list["Slot"],
                 *, bytes_per_second: float = 0.0, timeout: float = 120.0, budget: float = 0.0) -> None:
        self.group = group
        self.send_to, self.recv_from = send_to, recv_from
        self.replicas = replica_slots
        self.bytes_per_second = bytes_per_second
        self.timeout = timeout
        # the share of wall-clock time replica rounds may take (0: no bound): after a round of d
        # seconds the next one starts no sooner than d x (1 / budget - 1) later
        self.budget = budget
        self._ready_at = 0.0
        self.agreed_step = -1
        self.agreed_slot: Slot | None = None
        self.done: tuple[int, "Slot"] | None = None  # the newest round that succeeded on this rank
        self.replica_newest: Slot | None = None
        self.errors = 0
        self.last_error = ""
        self.copied_bytes = 0
        self.seconds: list[float] = []
        # the link from ``recv_from`` as the last replica measured it: (bytes received, seconds this
        # rank waited for them once its receives were posted); the straggler logic's link evidence
        self.link_in: tuple[int, float] | None = None
        self._in_seconds = 0.0
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sentinel-replica", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        with self._lock:
            return self._current is not None or not self._jobs.empty()

    def pausing(self) -> bool:
        """A round is running or queued, or the budget's pause after the last one has not ended."""
        return self.busy() or time.monotonic() < self._ready_at

    def slots_in_use(self) -> list["Slot"]:
        """The own slots this thread is reading or will read (the one being copied, those queued)."""
        with self._lock, self._jobs.mutex:
            queued = list(self._jobs.queue)
            pending = [self.done[1]] if self.done is not None and self.done[0] > self.agreed_step else []
            return pending + [j.slot for j in ([self._current] if self._current is not None else []) + queued
                              if j is not None]

    def done_step(self) -> int:
        with self._lock:
            return self.done[0] if self.done is not None else -1

    def agree(self, step: int) -> None:
        """Every rank's round of ``step`` succeeded (the least ``done`` step of every rank, from the
        guard's all-reduce): that step's own slot is the agreed copy from now on."""
        with self._lock:
            if self.done is not None and self.done[0] == step and step > self.agreed_step:
                self.agreed_step, self.agreed_slot = step, self.done[1]

    def submit(self, step: int, slot: "Slot") -> Job:
        job = Job(step, slot)
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
        if self._thread.is_alive():  # still in a copy: a daemon thread inside torch at exit can abort the process
            log.warning("memory replica thread still copying %.0f s after close", timeout)

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
            took = time.perf_counter() - t0
            self.seconds.append(took)
            if 0 < self.budget < 1:
                self._ready_at = time.monotonic() + took * (1 / self.budget - 1)
            with self._lock:
                self._current = None
            job.done.set()

    def _replicate(self, job: Job) -> bool:
        """Send the staged own slot to the partner and receive the partner's into a replica slot;
        this rank's verdict goes to ``done`` (the agreement is the guard's: :meth:`agree`). Few round
        trips, each with little Python between them: the head (step, length, CRC32, meta) and the
        first chunk go in one batch, then the other chunks. This thread shares the interpreter with
        the training loop, so every wake-up here can delay it; the work itself is in gloo and zlib,
        without the GIL."""
        own = job.slot
        ok = True
        self._in_seconds = 0.0
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
                self.link_in = (n_in + HEAD_BYTES, self._in_seconds)
            self.copied_bytes += own.data_len
        if ok:
            with self._lock:
                self.done = (job.step, own)
                if not collective(2):  # one process: its verdict is everyone's
                    self.agreed_step, self.agreed_slot = job.step, own
        return ok

    def _exchange(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Post every (send to the partner, receive from the other partner) at once; wait for all,
        the receives first: their wait is the link from ``recv_from`` (``link_in``)."""
        t0 = time.perf_counter()
        recvs, sends = [], []
        for out, into in pairs:
            if into.numel():
                recvs.append(dist.irecv(into, src=self.recv_from, group=self.group))
            if out.numel():
                sends.append(dist.isend(out, dst=self.send_to, group=self.group))
        for w in recvs:
            w.wait()
        self._in_seconds += time.perf_counter() - t0
        for w in sends:
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
    return dist.get_rank() if collective(2) else 0


def collective(world: int) -> bool:
    return world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

