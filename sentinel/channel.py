"""The daemon <-> trainer control channel: one versioned message format over Unix datagrams.

Layout under ``SENTINEL_RUNTIME_DIR`` (default ``/run/sentinel``)::

    ranks/<pid>.sock   one per training rank, bound by the rank (directory mode 1733: anyone
                       may create, nobody may list or delete another's socket)
    daemon.sock        the daemon's, for acknowledgements

Security: every rank socket has ``SO_PASSCRED``, so each datagram carries kernel-verified
credentials (``SCM_CREDENTIALS``). A rank acts on a request only when it comes from root or the
daemon's configured uid; anything else is refused and counted. A malformed message is ignored
and counted. The daemon, in turn, accepts an acknowledgement only from the pid that owns the
rank socket it claims.

Cost: :meth:`RankEndpoint.poll` is one non-blocking ``recvmsg`` returning EAGAIN when idle
(about a microsecond). With no runtime directory (no daemon installed) the rank gets a
:class:`NullEndpoint` that does nothing. A daemon restart changes nothing for a running job: the
rank sockets stay where they are and the new daemon finds them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("sentinel.channel")

VERSION = 1
REQUEST_TYPES = ("snapshot", "migrate")
MAX_MESSAGE = 4096
_UCRED = struct.Struct("3i")  # pid, uid, gid


def runtime_dir() -> Path:
    return Path(os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"))


class MalformedMessage(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    type: str  # "snapshot" | "migrate"
    id: str
    reason: str = ""
    # migrate only: how long the ranks must hold after committing, at least (the daemon's ack
    # timeout plus its drain budget), so a hold never ends before the node is drained.
    hold_seconds: float = 0.0
    version: int = VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


@dataclass(frozen=True)
class Ack:
    id: str
    rank: int
    step: int
    ok: bool
    path: str = ""
    blocked_seconds: float = 0.0
    error: str = ""
    pid: int = 0
    request_type: str = ""
    # "staged": the state is in host memory and the write has begun (sent at once, so the daemon
    # knows the rank is alive and how big the write is); "committed": the snapshot is durable
    # (or failed, ok=False). Only "committed" completes a request.
    phase: str = "committed"
    bytes: int = 0
    type: str = "ack"
    version: int = VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def decode(data: bytes) -> Request | Ack:
    """Parse one datagram; raises MalformedMessage for anything not exactly a v1 message."""
    if len(data) > MAX_MESSAGE:
        raise MalformedMessage("message too long")
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedMessage(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("version") != VERSION:
        raise MalformedMessage("not a version-1 message")
    kind = msg.get("type")
    try:
        if kind in REQUEST_TYPES:
            if not isinstance(msg.get("id"), str) or not isinstance(msg.get("reason", ""), str) or not msg["id"]:
                raise MalformedMessage("request needs a string id and reason")
            hold = msg.get("hold_seconds", 0.0)
            if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold < 1e6:
                raise MalformedMessage("hold_seconds must be a number of seconds")
            return Request(type=kind, id=msg["id"], reason=msg.get("reason", ""), hold_seconds=float(hold))
        if kind == "ack":
            ack = Ack(**{k: v for k, v in msg.items()})
            if not isinstance(ack.id, str) or not isinstance(ack.step, int) or not isinstance(ack.ok, bool):
                raise MalformedMessage("ack fields of the wrong type")
            if ack.phase not in ("staged", "committed") or isinstance(ack.bytes, bool) or not isinstance(ack.bytes, int):
                raise MalformedMessage("ack phase must be staged or committed, bytes an integer")
            return ack
    except TypeError as exc:
        raise MalformedMessage(f"unexpected fields: {exc}") from None
    raise MalformedMessage(f"unknown message type {kind!r}")


def _recv_with_creds(sock: socket.socket) -> tuple[bytes, int, int] | None:
    """(data, pid, uid) of the next datagram, or None when none is waiting."""
    try:
        data, ancdata, _flags, _addr = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(_UCRED.size))
    except BlockingIOError:
        return None
    pid = uid = -1
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack(payload[: _UCRED.size])
    return data, pid, uid


def _bind_dgram(path: Path, mode: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock.bind(str(path))
    os.chmod(path, mode)
    return sock


# ---------------------------------------------------------------------------------------------
# Rank side
# ---------------------------------------------------------------------------------------------
class NullEndpoint:
    """No daemon on this node: every call is a no-op."""

    active = False
    counts: Counter[str] = Counter()

    def poll(self) -> list[Request]:
        return []

    def ack(self, ack: Ack) -> bool:
        return False

    def close(self) -> None:
        return None


class RankEndpoint:
    """A training rank's end: receives requests (verified sender), sends acknowledgements."""

    active = True

    def __init__(self, directory: Path, *, allowed_uids: frozenset[int] = frozenset({0})) -> None:
        self.directory = directory
        self.allowed_uids = allowed_uids
        self.counts: Counter[str] = Counter()
        self.path = directory / "ranks" / f"{os.getpid()}.sock"
        self.sock = _bind_dgram(self.path, 0o622)  # the daemon (root) writes; others cannot read

    @classmethod
    def open(cls, directory: Path | None = None) -> "RankEndpoint | NullEndpoint":
        """A live endpoint when the daemon's runtime directory exists, else a NullEndpoint."""
        directory = directory or runtime_dir()
        if not (directory / "ranks").is_dir():
            return NullEndpoint()
        uids = {0}
        extra = os.environ.get("SENTINEL_DAEMON_UID", "")
        if extra.isdigit():
            uids.add(int(extra))
        try:
            return cls(directory, allowed_uids=frozenset(uids))
        except OSError:
            return NullEndpoint()

    def poll(self) -> list[Request]:
        """Non-blocking: the requests waiting now (usually none)."""
        out: list[Request] = []
        while True:
            got = _recv_with_creds(self.sock)
            if got is None:
                return out
            data, pid, uid = got
            if uid not in self.allowed_uids:
                self.counts["refused_sender"] += 1
                if self.counts["refused_sender"] == 1 or self.counts["refused_sender"] % 1000 == 0:
                    log.warning("refused %d control message(s) from a sender that is not the daemon (last: pid %d uid %d)",
                                self.counts["refused_sender"], pid, uid)
                continue
            try:
                msg = decode(data)
            except MalformedMessage as exc:
                self.counts["malformed"] += 1
                if self.counts["malformed"] == 1 or self.counts["malformed"] % 1000 == 0:
                    log.warning("ignored %d malformed control message(s) (last: %s)", self.counts["malformed"], exc)
                continue
            if not isinstance(msg, Request):
                self.counts["malformed"] += 1
                continue
            self.counts[f"request_{msg.type}"] += 1
            out.append(msg)

    def ack(self, ack: Ack) -> bool:
        try:
            self.sock.sendto(ack.encode(), str(self.directory / "daemon.sock"))
            return True
        except OSError:
            self.counts["ack_failed"] += 1
            return False

    def close(self) -> None:
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------
# Daemon side
# ---------------------------------------------------------------------------------------------
@dataclass
class RequestState:
    request: Request
    sent_to: set[int] = field(default_factory=set)  # rank pids
    acks: dict[int, Ack] = field(default_factory=dict)  # pid -> ack


class DaemonEndpoint:
    """The daemon's end: sends requests to every local rank, collects acknowledgements."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ranks_dir = directory / "ranks"
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.ranks_dir, 0o1733)
        self.sock = _bind_dgram(directory / "daemon.sock", 0o622)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.requests: dict[str, RequestState] = {}

    def rank_pids(self) -> list[int]:
        pids = []
        try:
            names = os.listdir(self.ranks_dir)
        except OSError:
            return []
        for name in names:
            stem, _, ext = name.partition(".")
            if ext == "sock" and stem.isdigit():
                pids.append(int(stem))
        return sorted(pids)

    def request(self, kind: str, request_id: str, reason: str, pids: list[int] | None = None) -> int:
        """Send to every local rank (or only ``pids``); returns how many received it.
        Sockets of ranks that exited are removed."""
        req = Request(type=kind, id=request_id, reason=reason)
        state = self.requests.setdefault(request_id, RequestState(req))
        data = req.encode()
        for pid in self.rank_pids() if pids is None else pids:
            path = self.ranks_dir / f"{pid}.sock"
            try:
                self.sock.sendto(data, str(path))
                state.sent_to.add(pid)
                self.counts[(kind, "sent")] += 1
            except (ConnectionRefusedError, FileNotFoundError):
                self.counts[(kind, "stale_rank")] += 1
                path.unlink(missing_ok=True)
            except OSError as exc:
                self.counts[(kind, "error_" + errno.errorcode.get(exc.errno or 0, "unknown").lower())] += 1
        return len(state.sent_to)

    def poll_acks(self) -> list[Ack]:
        out = []
        while True:
            got = _recv_with_creds(self.sock)
            if got is None:
                return out
            data, pid, _uid = got
            try:
                msg = decode(data)
            except MalformedMessage:
                self.counts[("ack", "malformed")] += 1
                continue
            if not isinstance(msg, Ack) or not (self.ranks_dir / f"{pid}.sock").exists():
                self.counts[("ack", "refused")] += 1
                continue
            msg = Ack(**{**asdict(msg), "pid": pid})
            state = self.requests.get(msg.id)
            if state is not None:
                state.acks[pid] = msg
            self.counts[("ack", "ok" if msg.ok else "error")] += 1
            out.append(msg)

    def complete(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        return bool(state and state.sent_to and state.sent_to <= set(state.acks))

    def metric_counters(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {("sentinel_channel_messages", (("kind", k), ("outcome", o))): float(n) for (k, o), n in self.counts.items()}

    def close(self) -> None:
        self.sock.close()
        (self.directory / "daemon.sock").unlink(missing_ok=True)


def send_raw(path: Path, data: bytes) -> None:
    """Send one datagram (tests and tools)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))

