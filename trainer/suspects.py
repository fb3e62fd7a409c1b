"""A dead node told from the job's own errors, not from keep-alive expiry (issue #48).

When a node's processes die suddenly (kill -9, the OOM killer, a crash), every survivor's
collective fails within milliseconds: the dead processes' kernel closed their sockets, and gloo says
``Read error [ADDR]:PORT: Connection reset by peer``. Waiting for the dead node's keep-alive to
expire (``admission_timeout``, seconds) throws that knowledge away. (A host that powers off or
panics closes nothing and answers nothing: keep-alive expiry still tells that one.) Here:

* **The evidence** (:func:`evidence_of`): the agent reads its failed workers' own error records
  (torch's elastic error files: the exception each worker died with) and keeps a connection-loss
  error (reset, closed or refused by the peer, broken pipe) as *evidence that a peer's process is
  gone*. A worker that died of anything else (its own crash, a signal, a timeout) is no evidence.
* **The check** (:func:`probe`): evidence says *some* peer closed its sockets, not *which node*
  died: a rank that crashed while its node and agent live closes its sockets just the same. So
  every agent keeps a listening socket (:class:`Liveness`, its address in its arrival record), and
  the slot rendezvous probes the nodes that have not re-arrived: a TCP connect that is **refused**
  means the agent's process is gone while its host's kernel still answers — the node is dead. A
  connect that is accepted means the process lives: a stopped or CPU-starved process still has
  its socket, and the kernel completes the handshake for it (it is slow, not gone). A connect that
  times out or finds no route (a host powered off, a link down, a paused VM) decides nothing: that
  slot is left to keep-alive expiry, as before.

Why both (docs/rendezvous.md, "Sudden loss"): the evidence alone would evict the node of a rank
that crashed before its agent re-arrives (its connections reset too); the probe alone would need
every survivor to probe every node on every round. Evidence starts the probing (one survivor, the
first to report, probes for one ``admission_timeout``; so does an admitted spare), the probe
decides. No torch import here.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import socket
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("sentinel.rendezvous")

PROBE_SECONDS = 0.05  # the prober's pass interval while its evidence is fresh
PROBE_TIMEOUT = 0.5  # one connect; longer means "no answer", which decides nothing
ALIVE_RECHECK = 0.5  # a node found alive is probed again after this
BACKLOG = 1024  # probes waiting to be drained (the heartbeat thread drains them)

# what a collective says when a peer's process closed its sockets (gloo, c10d's TCPStore, NCCL's
# socket bootstrap); lower case, matched in the worker's error message
CONNECTION_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe",
                   "connection refused", "econnreset", "epipe", "connection was likely closed")
_PEER = re.compile(r"\[([0-9A-Fa-f:.]{2,45})\]:(\d{1,5})")

ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"


def evidence_of(failures: Mapping[int, Any]) -> str:
    """From torch's failed-worker records (``RunResult.failures``: local rank -> ``ProcessFailure``):
    "" when no worker died of a lost connection, else one line naming the rank, the error and the
    peer address the error names. Only fixed words and digits are kept of the worker's text (it is
    the job's: the line goes into the rendezvous store and the logs)."""
    for rank, failure in sorted(failures.items()):
        message = getattr(failure, "message", "")
        if isinstance(message, dict):  # torch's error file: {"message": "...", "extraInfo": {...}}
            message = message.get("message", "")
        text = str(message)[:4096]
        low = text.lower()
        hit = next((p for p in CONNECTION_LOST if p in low), None)
        if hit is None:
            continue
        peer = _PEER.search(text)
        named = peer is not None and 0 < int(peer.group(2)) < 65536
        return f"rank {int(rank)}: {hit}" + (f" (peer {peer.group(1)}:{int(peer.group(2))})" if named else "")
    return ""


def report(handler: Any, failures: Mapping[int, Any]) -> str:
    """The agent's part: its worker group failed (``failures``, torch's ``RunResult.failures``);
    if a worker died of a lost connection and the rendezvous handler takes evidence (the slot
    rendezvous's ``suspect``), hand it over. Returns the evidence ("" when none). Never raises."""
    take = getattr(handler, "suspect", None)
    evidence = evidence_of(failures) if take is not None else ""
    if evidence:
        log.warning("a worker died of a lost connection (%s): a peer's process may be gone; told the rendezvous",
                    evidence)
        take(evidence)
    return evidence


def record_vacancy(event: Mapping[str, Any]) -> None:
    """A slot declared vacant, as a line of the job's progress record where the job has one
    (``SENTINEL_PROGRESS_FILE``: the drill's timeline shows when the dead node was declared).
    Never raises: the record is for people, the declaration is already in the store."""
    from trainer.integrations.progress import ProgressRecord

    try:
        ProgressRecord.from_env(rank=-1)("vacant", **dict(event))
    except OSError as exc:
        log.debug("progress record: %s", exc)


def parse_address(address: Any) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) from a store record: None unless well formed."""
    if not isinstance(address, str) or len(address) > 300:
        return None
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if not re.fullmatch(r"[A-Za-z0-9.:_-]+", host):
        return None
    return host, int(port)


def probe(address: Any, timeout: float = PROBE_TIMEOUT) -> str:
    """Is the agent behind ``address`` alive? :data:`ALIVE` (the connect was accepted),
    :data:`GONE` (refused: nothing listens there any more, its host answered) or :data:`UNKNOWN`
    (no answer, no route, a malformed address). Never raises. Only a refusal of the SYN itself is
    GONE: a listener whose queue another user keeps full drops SYNs (UNKNOWN), and under
    ``net.ipv4.tcp_abort_on_overflow=1`` resets a handshake it cannot queue only after its SYN-ACK
    (the connect completed: ALIVE; tests/test_silence.py)."""
    where = parse_address(address)
    if where is None:
        return UNKNOWN
    try:
        with socket.create_connection(where, timeout=timeout):
            return ALIVE
    except ConnectionRefusedError:
        return GONE
    except OSError as exc:  # timeout, EHOSTUNREACH, ENETUNREACH: a host that does not answer
        if exc.errno == errno.ECONNREFUSED:
            return GONE
        return UNKNOWN


def here() -> str:
    """This host's network identity: the kernel's boot id and this network namespace. Two
    processes share a loopback only when both are equal."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def resolve(address: Any) -> list:
    """``getaddrinfo``'s stream entries for a ``host:port`` liveness address; [] when it is
    malformed or does not resolve."""
    where = parse_address(address)
    if where is None:
        return []
    try:
        return socket.getaddrinfo(where[0], where[1], type=socket.SOCK_STREAM)
    except OSError:
        return []


def kernel_of(holder: Mapping[str, Any]) -> str:
    """An arrival record's kernel-answer address (``kernel``): "" unless well formed and on the
    same host as its liveness address (``probe``), which :func:`reachable_from_here` checked."""
    kernel, probe_at = holder.get("kernel"), parse_address(holder.get("probe"))
    where = parse_address(kernel)
    return kernel if where is not None and probe_at is not None and where[0] == probe_at[0] else ""


def reachable_from_here(address: Any, there: Any, mine: str) -> bool:
    """Whether a probe of ``address`` from here asks the right host: an address that is (or
    resolves here to) a loopback one reaches this host's own loopback, so it is probed only when
    the node said it is on this host (``there``, its :func:`here`, equal to ``mine``); a refusal
    from the wrong host would declare a live node dead. Any other address: yes."""
    infos = resolve(address)
    if not infos:
        return False
    loopback = any(ipaddress.ip_address(info[4][0].split("%", 1)[0]).is_loopback for info in infos)
    return not loopback or (bool(mine) and there == mine)


class Liveness:
    """This agent's listening socket: its existence is the answer (a connect is accepted by the
    kernel even while the process is stopped; refused once the process is gone). Nothing is ever
    read or written; :meth:`drain` accepts and closes what queued (the heartbeat thread calls it).
    Opened on first use; ``address`` is "" when no socket could be opened (then nobody can tell
    this node dead early: keep-alive expiry still does).

    Beside it, the **kernel-answer port** (``kernel_address``, #41): a TCP port bound on the same
    interfaces but never listening. A connect to it is refused by the host's kernel at once, from
    the first packet, whatever the agent's state: no queue to fill (any user can fill the listening
    socket's accept queue, then the kernel drops SYNs and the host looks silent), and no other
    socket can take the port (bound without SO_REUSEADDR/SO_REUSEPORT: any later bind of it, any
    user, any address family, fails with EADDRINUSE). Only a host that is off or cut off leaves it
    unanswered (docs/security.md, "The silence rule")."""

    def __init__(self, addr: str | None) -> None:
        self.addr = addr or ""
        self._sock: socket.socket | None = None
        self._kernel: socket.socket | None = None
        self._tried = addr is None  # None: no socket (this node is told dead by keep-alive expiry only)

    @property
    def address(self) -> str:
        """``<this node's address>:<port>``: the name or address the node advertises (as for the
        workers' store it hosts), resolved by each prober as it resolves that one."""
        if not self._tried:
            self._tried = True
            self._sock = self._open(listen=True)
            self._kernel = self._open(listen=False) if self._sock is not None else None
        return self._named(self._sock)

    @property
    def kernel_address(self) -> str:
        """The kernel-answer port's ``<address>:<port>``; "" when it could not be bound."""
        return self._named(self._kernel) if self.address else ""

    def _named(self, sock: socket.socket | None) -> str:
        if sock is None or not self.addr:
            return ""
        port = sock.getsockname()[1]
        return f"[{self.addr}]:{port}" if ":" in self.addr else f"{self.addr}:{port}"

    @staticmethod
    def _open(listen: bool) -> socket.socket | None:
        """On every interface (dual-stack where the host has IPv6): the advertised name may
        resolve to any of them, as the workers' store's does. No SO_REUSEADDR, no SO_REUSEPORT:
        nothing else can bind the port while this socket holds it."""
        for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue
            try:
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, 0))
                if listen:
                    sock.listen(BACKLOG)
                sock.setblocking(False)
                return sock
            except OSError as exc:
                log.debug("liveness socket on %r: %s", host, exc)
                sock.close()
        log.warning("no liveness socket could be opened: this node's death is told by keep-alive expiry only")
        return None

    def drain(self, limit: int = BACKLOG) -> int:
        """Accept and close the queued probes, at most ``limit`` (what one full backlog holds); how
        many. Never raises. Bounded: the heartbeat thread calls it before each beat, and any local
        user can connect here — one who refills the queue as fast as it is drained must not hold
        the beat back (a live node whose heartbeat stands still is declared vacant)."""
        n = 0
        while self._sock is not None and n < limit:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # BlockingIOError: nothing queued
                return n
            conn.close()
            n += 1
        return n

    def close(self) -> None:
        for sock in (self._sock, self._kernel):
            if sock is not None:
                sock.close()
        self._sock = self._kernel = None
