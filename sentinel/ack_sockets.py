"""The daemon's per-rank acknowledgement channels: one connected pair of Unix datagram sockets
per rank it asks, the rank's end handed to it with the request (``SCM_RIGHTS``).

Why: ``daemon.sock`` is open to the job's group (0660), so a process of the job's user or group
can keep its receive queue full; an acknowledgement sent there waits for room (up to the rank's
``ack_timeout``), and the drain waits with it though the snapshot is safe. A socket pair has no
name: nobody else can send to either end, and a datagram from one end to its connected peer
skips the receive-queue limit (``unix_dgram_sendmsg`` checks it only when the receiver is not
connected back to the sender). So the rank's acknowledgement on its end is one non-blocking send
that the kernel takes at once, flood or no flood, and nothing else can enter that queue.

The rank's end rides on a request datagram (the daemon's sends reach a rank past any queue limit
too: the rank's socket is connected to ``daemon.sock``), the first one to that rank after the
pair was made; a rank takes it only from a sender of a daemon uid (kernel-verified credentials).
A new pair is made for a new process holding the rank's name (pid reuse), and the daemon's end
is closed with the rank. A rank with no pair (an older daemon, or one restarted since: its send
fails on the closed end) acknowledges over ``daemon.sock`` as before. Never raises.

:class:`AckWatch` wakes the daemon's loop when an acknowledgement arrives on one of these pairs,
so a committed migrate snapshot is acted on at once instead of at the next poll.
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("sentinel.channel")


@dataclass
class _Pair:
    identity: tuple[int, int]  # the rank's (pid, start time)
    ours: socket.socket  # the daemon reads the rank's acks here
    theirs: socket.socket | None  # the rank's end until a request carried it


class AckChannels:
    """Rank socket name -> the pair made for the process that holds it."""

    def __init__(self) -> None:
        self._pairs: dict[str, _Pair] = {}
        self._pid_of: dict[int, int] = {}  # our end's descriptor -> the rank's pid (for AckWatch)
        self.errors = 0
        self.watch: AckWatch | None = None  # told of every pair made and closed

    def ensure(self, name: str, identity: tuple[int, int]) -> None:
        """A pair for the rank named ``name`` (made now when it has none, or one for another process)."""
        pair = self._pairs.get(name)
        if pair is not None and pair.identity == identity:
            return
        self.drop(name)
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        except OSError as exc:
            self.errors += 1
            log.warning("no acknowledgement channel for %s: %s", name, exc)
            return
        ours.setblocking(False)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the sender's pid, from the kernel
        self._pairs[name] = _Pair(identity, ours, theirs)
        self._pid_of[ours.fileno()] = identity[0]
        if self.watch is not None:
            self.watch.add(ours)

    def ancillary(self, name: str) -> list[tuple[int, int, bytes]]:
        """The control message that hands the rank its end with the next datagram (none once it did)."""
        pair = self._pairs.get(name)
        if pair is None or pair.theirs is None:
            return []
        return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pair.theirs.fileno()]).tobytes())]

    def handed(self, name: str) -> None:
        """A datagram carrying the rank's end was sent: the rank holds it now."""
        pair = self._pairs.get(name)
        if pair is not None and pair.theirs is not None:
            pair.theirs.close()
            pair.theirs = None

    def drop(self, name: str) -> None:
        pair = self._pairs.pop(name, None)
        if pair is not None:
            self._pid_of.pop(pair.ours.fileno(), None)
            if self.watch is not None:
                self.watch.remove(pair.ours)
            pair.ours.close()
            if pair.theirs is not None:
                pair.theirs.close()

    def keep_only(self, names: set[str]) -> None:
        """Close the pairs of ranks that are not (or no longer) among ``names``."""
        for name in [n for n in self._pairs if n not in names]:
            self.drop(name)

    def pid_of(self, fd: int) -> int | None:
        """The pid of the rank whose pair's daemon end is descriptor ``fd`` (None: not a pair's)."""
        return self._pid_of.get(fd)

    def sockets(self) -> list[socket.socket]:
        return [pair.ours for pair in self._pairs.values()]

    def close(self) -> None:
        for name in list(self._pairs):
            self.drop(name)


class AckWatch:
    """A thread that calls ``wake`` when a datagram arrives on the daemon's end of a rank's pair
    while ``expecting(fd)`` is true (that pair's rank still owes an acknowledgement of an open
    request): the daemon's loop otherwise read them only at its next poll
    (``poll_interval_seconds``, 1 s by default), and the drain of a node whose snapshot was
    committed waited for it. The thread reads nothing (the loop does, as before): edge-triggered
    epoll, one wake at most every ``min_gap`` seconds. A rank's first ``free_wakes`` wakes of a
    round (:meth:`new_round`: a request was sent) are immediate; after them that pair's wakes are
    ``slow_gap`` apart (deferred, not lost), so a rank that withholds its ack and writes to its own
    pair costs the daemon at most 1/``slow_gap`` loop passes a second, and never delays another
    rank's wake (review of session 19: ~100 passes a second for up to ``retry_seconds``). Never
    raises."""

    FREE_WAKES = 4  # a rank acknowledges a request with one or two datagrams (staged, committed)
    SLOW_GAP = 0.2  # the daemon's kernel-event batching (daemon.EVENT_BATCH_SECONDS)

    def __init__(self, wake: Callable[[], None], expecting: Callable[[int], bool], *, min_gap: float = 0.01,
                 free_wakes: int = FREE_WAKES, slow_gap: float = SLOW_GAP) -> None:
        self._wake = wake
        self._expecting = expecting
        self._min_gap, self._free, self._slow_gap = min_gap, free_wakes, slow_gap
        self._woken: dict[int, tuple[int, float]] = {}  # fd -> (wakes this round, the last one's time)
        self.deferred = 0  # wakes held back to a pair's slow gap
        self._ep = select.epoll()
        self._stop_r, self._stop_w = os.pipe()
        self._ep.register(self._stop_r, select.EPOLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sentinel-ack-watch", daemon=True)
        self._thread.start()

    def new_round(self) -> None:
        """A request was sent: every pair's free wakes again."""
        self._woken = {}

    def add(self, sock: socket.socket) -> None:
        try:
            self._ep.register(sock.fileno(), select.EPOLLIN | select.EPOLLET)
        except (OSError, ValueError) as exc:  # closed meanwhile, or already watched: the poll still reads it
            log.debug("ack watch: %s", exc)

    def remove(self, sock: socket.socket) -> None:
        try:
            self._ep.unregister(sock.fileno())
        except (OSError, ValueError):
            pass  # not watched (or already gone with its descriptor)

    def _admit(self, fd: int, now: float) -> float | None:
        """When ``fd``'s wake may happen (``now``: at once); None: its rank owes nothing."""
        if not self._expecting(fd):
            return None
        count, last = self._woken.get(fd, (0, float("-inf")))
        at = now if count < self._free else max(now, last + self._slow_gap)
        if at <= now:
            self._woken[fd] = (count + 1, now)
        return at

    def _run(self) -> None:
        deferred: dict[int, float] = {}  # fd -> when its held-back wake is due
        while True:
            timeout = max(0.0, min(deferred.values()) - time.monotonic()) if deferred else -1
            try:
                events = self._ep.poll(timeout)
            except OSError:  # EINTR, or the epoll closed under us at close()
                if self._closed:
                    return
                continue
            if self._closed or any(fd == self._stop_r for fd, _ in events):
                return
            now = time.monotonic()
            fired = {fd for fd, _ in events} | {fd for fd, at in deferred.items() if at <= now}
            wake = False
            try:
                for fd in fired:
                    deferred.pop(fd, None)
                    at = self._admit(fd, now)
                    if at is not None and at <= now:
                        wake = True
                    elif at is not None:
                        deferred[fd] = at
                        self.deferred += 1
                if wake:
                    self._wake()
            except Exception:  # noqa: BLE001 - a failed wake only leaves the ack to the next poll
                log.exception("ack watch: waking the daemon failed")
            if wake:
                time.sleep(self._min_gap)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        self._ep.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
