"""A host that answers nothing told by the waiting spare, without a reset or any evidence (#41).

A host that powers off (or whose link is cut) closes nothing: no FIN, no RST reaches its peers,
their collectives simply block, and the liveness probe of :mod:`trainer.suspects` gets no answer
— neither accepted nor refused. Until #41 such a slot was found only by keep-alive expiry (two
watcher passes: 3-9 s in the netns drill). Here the **waiting spare** (idle by definition, and the
one that will take the slot) watches the committed generation's agents all the time:

* every ``interval`` it starts a non-blocking TCP connect to each agent's liveness socket and one
  to its **kernel-answer port** (:class:`trainer.suspects.Liveness`: bound, never listening; one
  pair in flight per slot and interval; a connect stays open up to the slot's window, so a late
  answer still counts);
* any answer — the handshake completed (the kernel does it for a stopped or CPU-starved process)
  or a refusal (the host's kernel answered; the kernel-answer port always refuses) — ends that
  slot's silence. Any local user can fill the liveness socket's accept queue (the kernel then
  drops its SYNs), nobody can fill or take the kernel-answer port: while the host is on and
  reachable, it answers;
* a slot is **silent** once every probe sent to it over its window went unanswered (no answer, a
  timeout, no route), at least ``MIN_PROBES`` of them, while the prober heard from another slot
  in that window (it is not the one cut off), the slot's heartbeat did not move, and its
  kernel-answer port answered this prober before (a port that never answered — none advertised,
  or refusals filtered on the path — proves nothing: that slot is left to keep-alive expiry).

The window is ``max(window, RTT_FACTOR x the slot's largest recent round trip)``: it must exceed
the round trip of any live host, queueing included — a live host whose answers queue behind a
saturated, shaped link (the drill's ``slow-link``: ``tbf latency 400ms`` each way, up to 0.8 s)
must not look silent. Nothing here writes the store: :meth:`trainer.slot_recovery.Recovery.
silence_pass` declares. No torch import (docs/rendezvous.md, "A host that answers nothing").
"""

from __future__ import annotations

import errno
import resource
import select
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from trainer import suspects

WINDOW_SECONDS = 1.0  # default silence window (--rdzv-conf silence_window): above the drill's 0.8 s shaped RTT
INTERVAL_SECONDS = 0.1  # one probe pair per slot per interval (O(N) connects per pass: N x 1 ms at most)
MIN_PROBES = 3  # unanswered probes a silence needs (one lost SYN is not a dead host)
RTT_FACTOR = 4  # a slot's window is at least this times its largest recent round trip
RTT_KEPT = 50  # round trips remembered per slot
NO_ANSWER = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN)
ANSWERED = (0, errno.EISCONN, errno.ECONNREFUSED)


@dataclass
class _Slot:
    """What the watcher knows of one slot's agent at one address."""
    where: tuple | None  # (family, sockaddr); None: it could not be resolved (never silent)
    kernel: tuple | None = None  # its kernel-answer port, resolved; None: none (never silent)
    kernel_answered: bool = False  # that port answered this prober once (its path delivers refusals)
    inflight: dict[int, tuple[socket.socket, float, bool]] = field(default_factory=dict)  # fd -> (socket, sent, kernel?)
    pending: deque = field(default_factory=deque)  # send times of the probes sent after the newest answered one
    answered_at: float = -1e18  # newest send time of a probe that got an answer
    heard_at: float = -1e18  # when the newest answer was seen
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_KEPT))
    beat: bytes | None = None  # the heartbeat read when the current silence was first suspected
    suspected: bool = False
    last_sent: float = -1e18


class SilenceWatch:
    """Non-blocking probes of many agents' liveness sockets; :meth:`step` once per ``interval``.
    ``clock``, ``connect`` (``connect(sock, sockaddr)``: the socket's own ``connect_ex``) and
    ``rtt`` (a connected probe's handshake round trip, seconds) are injectable (tests). Never
    raises on a probe's error; owns every socket it opens."""

    def __init__(self, window: float = WINDOW_SECONDS, interval: float = INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[socket.socket, tuple], int] | None = None,
                 rtt: Callable[[socket.socket], float | None] | None = None,
                 max_inflight: int | None = None) -> None:
        if window <= 0 or interval <= 0:
            raise ValueError("the silence window and the probe interval must be > 0")
        self.window = window
        self.interval = interval
        self._clock = clock
        self._connect = connect or (lambda sock, addr: sock.connect_ex(addr))
        self._rtt = rtt or _handshake_rtt
        self._slots: dict[tuple[int, str], _Slot] = {}
        self.sent = 0  # probes started, all slots (costs)
        # sockets in flight, all slots: a probe unanswered stays open its window (2 x window /
        # interval a slot), so many silent slots (a rack's power, forged records) would otherwise
        # take every descriptor of this process (its store connections too)
        self.max_inflight = max_inflight or _inflight_cap()
        self._turn = 0

    def window_of(self, slot: _Slot) -> float:
        return max(self.window, RTT_FACTOR * max(slot.rtts, default=0.0))

    def step(self, targets: dict[int, tuple[str, str]], beat: Callable[[int], bytes | None]) -> list[tuple[int, str, float]]:
        """One pass over ``targets`` (slot -> its agent's (liveness address, kernel-answer
        address), already checked as probeable from here): collect answers, start the probes that
        are due, and return the slots now silent as ``(slot, liveness address, window)``.
        ``beat(slot)`` reads a slot's heartbeat (a store read, only for a slot whose probes went
        unanswered for two intervals). A slot with no kernel-answer port, or whose port never
        answered this prober, is never silent: a full accept queue alone would look the same."""
        now = self._clock()
        targets = {slot: (t, "") if isinstance(t, str) else tuple(t) for slot, t in targets.items()}
        for key in [k for k in self._slots if targets.get(k[0]) != k[1]]:  # a slot's holder changed
            self._forget(key)
        for slot, pair in targets.items():
            if (slot, pair) not in self._slots:
                self._slots[(slot, pair)] = _Slot(where=_resolve(pair[0]), kernel=_resolve(pair[1]))
        self._collect(now, 0.0)
        room = self.max_inflight - sum(len(st.inflight) for st in self._slots.values())
        slots = list(self._slots.values())
        turn, self._turn = self._turn % max(1, len(slots)), self._turn + 1  # who starts first: in turn
        for st in slots[turn:] + slots[:turn]:
            if st.where is not None and now - st.last_sent >= self.interval:
                if room < 2:
                    break  # at the cap: the rest wait (a probe not sent is not pending)
                before = len(st.inflight)
                self._start(st, now)
                room -= len(st.inflight) - before
        self._collect(self._clock(), 0.002)  # a LAN's answers come within the pass
        return self._silent(self._clock(), beat)

    def _silent(self, now: float, beat: Callable[[int], bytes | None]) -> list[tuple[int, str, float]]:
        out = []
        for (slot, (address, _)), st in self._slots.items():
            if not st.pending:
                st.suspected, st.beat = False, None
                continue
            since = st.pending[0]  # the first probe sent after the last answer
            if not st.suspected and now - since >= 2 * self.interval:
                st.suspected, st.beat = True, beat(slot)  # read once per suspicion
            window = self.window_of(st)
            if not st.suspected or now - since < window or not st.kernel_answered:
                continue
            if sum(1 for t in st.pending if now - t >= self.interval) < MIN_PROBES:
                continue
            others = [o for o in self._slots.values() if o is not st and o.where is not None]
            if others and not any(o.heard_at >= since for o in others):
                continue  # nobody answered this prober meanwhile: it may be the one cut off
            if beat(slot) == st.beat:
                out.append((slot, address, window))
        return out

    def _start(self, st: _Slot, now: float) -> None:
        """One probe of the liveness socket and one of the kernel-answer port, both sent ``now``:
        an answer from either is an answer of the host. A probe none of whose sockets could be
        opened (this process out of descriptors or buffers) was not sent: it is not pending."""
        st.last_sent = now
        for where, kernel in ((st.where, False), (st.kernel, True)):
            if where is None:
                continue
            try:
                sock = socket.socket(where[0], socket.SOCK_STREAM)
            except OSError:
                continue
            if not st.pending or st.pending[-1] != now:
                st.pending.append(now)
                while len(st.pending) > 4 * RTT_KEPT:
                    st.pending.popleft()
            sock.setblocking(False)
            self.sent += 1
            err = self._connect(sock, where[1])
            if err == errno.EINPROGRESS:
                st.inflight[sock.fileno()] = (sock, now, kernel)
                continue
            sock.close()
            self._settle(st, now, now, err, kernel=kernel)

    def _collect(self, now: float, wait: float) -> None:
        """Answers to the probes in flight (waiting up to ``wait`` s for one); a probe older than
        its slot's window is closed, unanswered (it stays pending)."""
        poller = select.poll()
        owner: dict[int, _Slot] = {}
        for st in self._slots.values():
            for fd in st.inflight:
                poller.register(fd, select.POLLOUT | select.POLLERR | select.POLLHUP)
                owner[fd] = st
        if not owner:
            return
        for fd, _ in poller.poll(int(wait * 1000)):
            st = owner[fd]
            sock, sent, kernel = st.inflight.pop(fd)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            rtt = self._rtt(sock) if err == 0 else None
            sock.close()
            self._settle(st, sent, self._clock(), err, rtt, kernel)
        for st in owner.values():
            for fd, (sock, sent, _) in list(st.inflight.items()):
                if now - sent >= self.window_of(st):
                    del st.inflight[fd]
                    sock.close()

    def _settle(self, st: _Slot, sent: float, now: float, err: int, rtt: float | None = None,
                kernel: bool = False) -> None:
        """One probe's outcome: an answer ends the silence of every probe sent before it; no
        answer (a timeout, no route) keeps it pending; any other error says nothing of the host.
        ``rtt``: the kernel's own measure of the handshake (else: until the answer was seen,
        which a prober descheduled under load overstates — the safe direction)."""
        if err in ANSWERED:
            st.kernel_answered = st.kernel_answered or kernel
            st.answered_at = max(st.answered_at, sent)
            st.heard_at = now
            st.rtts.append(rtt if rtt is not None else now - sent)
            while st.pending and st.pending[0] <= st.answered_at:
                st.pending.popleft()
        elif err not in NO_ANSWER and sent in st.pending:
            st.pending.remove(sent)

    def _forget(self, key: tuple[int, str]) -> None:
        for sock, _, _ in self._slots.pop(key).inflight.values():
            sock.close()

    def close(self) -> None:
        """Close every probe in flight."""
        for key in list(self._slots):
            self._forget(key)


def _handshake_rtt(sock: socket.socket) -> float | None:
    """The round trip of a connected socket's handshake as its kernel measured it (``TCP_INFO``'s
    ``tcpi_rtt``, microseconds at byte 68: Linux), in seconds; None where it cannot be read."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO"), 104)
        return struct.unpack_from("I", info, 68)[0] / 1e6 if len(info) >= 72 else None
    except (OSError, AttributeError, struct.error):
        return None


def _inflight_cap() -> int:
    """Half of this process's descriptor limit (at least 64, at most 16,384)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 16384 if soft == resource.RLIM_INFINITY else max(64, min(16384, soft // 2))


def _resolve(address: str) -> tuple | None:
    """``(family, sockaddr)`` of a liveness address, or None (empty, malformed, unresolvable)."""
    infos = suspects.resolve(address) if address else []
    return (infos[0][0], infos[0][4]) if infos else None
