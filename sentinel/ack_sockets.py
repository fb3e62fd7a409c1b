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
"""

from __future__ import annotations

import array
import logging
import socket
from dataclasses import dataclass

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
        self.errors = 0

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
            pair.ours.close()
            if pair.theirs is not None:
                pair.theirs.close()

    def keep_only(self, names: set[str]) -> None:
        """Close the pairs of ranks that are not (or no longer) among ``names``."""
        for name in [n for n in self._pairs if n not in names]:
            self.drop(name)

    def sockets(self) -> list[socket.socket]:
        return [pair.ours for pair in self._pairs.values()]

    def close(self) -> None:
        for name in list(self._pairs):
            self.drop(name)
