"""The rendezvous store as the slot protocol sees it: every operation counted (ops and bytes, so
the replacement's cost per survivor is measured, not guessed), and the generation-fenced writes
(:mod:`trainer.fence`) routed to the store's own transaction where it has one (etcd v3) or to a
compare-then-set (a c10d TCPStore). Any store with the c10d calls works: a ``TCPStore``, a
``PrefixStore`` over one, or :class:`trainer.etcd_store.EtcdStore`. No torch import here."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from trainer import fence


@dataclass
class OpStats:
    """Store operations one handler made (every protocol op goes through :class:`CountingStore`)."""

    ops: dict[str, int] = field(default_factory=dict)
    bytes_out: int = 0
    bytes_in: int = 0
    refused: int = 0  # fenced writes refused (not store operations)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def snapshot(self) -> tuple[int, int, int]:
        return self.total, self.bytes_out, self.bytes_in


class CountingStore:
    """A c10d store seen through the operations the protocol makes: counts ops and bytes.
    Thread-safe counters (the heartbeat thread counts into the same stats)."""

    def __init__(self, store: Any, stats: OpStats | None = None) -> None:
        self.store = store
        self.stats = stats or OpStats()
        self._lock = threading.Lock()

    def _count(self, op: str, out: int, got: int = 0) -> None:
        with self._lock:
            self.stats.ops[op] = self.stats.ops.get(op, 0) + 1
            self.stats.bytes_out += out
            self.stats.bytes_in += got

    def get(self, key: str) -> bytes:
        v = self.store.get(key)
        self._count("get", len(key), len(v))
        return v

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)
        self._count("set", len(key) + len(value))

    def add(self, key: str, n: int) -> int:
        v = self.store.add(key, n)
        self._count("add", len(key) + 8, 8)
        return v

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        v = self.store.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + len(expected) + len(desired), len(v))
        return v

    def check(self, keys: list[str]) -> bool:
        v = self.store.check(keys)
        self._count("check", sum(map(len, keys)), 1)
        return v

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        try:
            self.store.wait(keys, timeout)
        finally:
            self._count("wait", sum(map(len, keys)), 1)

    def fenced_set(self, fence_key: str, token: str, key: str, value: str) -> bool:
        """Write ``key`` only while ``fence_key`` holds ``token`` (:func:`trainer.fence.fenced_set`;
        the store's own transaction where it has one, counted as one op)."""
        if getattr(self.store, "fenced_set", None) is not None:
            ok = fence.fenced_set(self.store, fence_key, token, key, value)
            self._count("fenced_set", len(fence_key) + len(token) + len(key) + len(value))
        else:  # our compare_set and set, counted as they are
            ok = fence.compare_then_set(self, fence_key, token, key, value)
        if not ok:
            self.refuse()
        return ok

    def refuse(self) -> None:  # a write refused by the generation fence
        with self._lock:
            self.stats.refused += 1

    def fenced_beat(self, fence_key: str, token: str, key: str, value: str) -> bool:
        """A heartbeat fenced like :meth:`fenced_set`: the store's own ``beat`` where it has one
        (etcd: a key on this connection's lease, written in the same transaction as the compare),
        else :meth:`fenced_set`."""
        beat = getattr(self.store, "beat", None)
        if beat is None:
            return self.fenced_set(fence_key, token, key, value)
        ok = bool(beat(key, value, fence=(fence_key, token)))
        self._count("beat", len(fence_key) + len(token) + len(key) + len(value))
        if not ok:
            self.refuse()
        return ok

    def clone(self, stats: OpStats | None = None) -> "CountingStore":
        """A second connection (its own socket: a heartbeat is never queued behind a wait)."""
        clone = getattr(self.store, "clone", None)
        return CountingStore(clone() if clone is not None else self.store, stats)
