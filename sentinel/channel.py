"""The daemon <-> trainer control channel: one versioned message format over Unix datagrams.

Layout under ``SENTINEL_RUNTIME_DIR`` (default ``/run/sentinel``, root-owned, mode 0755)::

    ranks/<pid>.sock          one per training rank, bound by the rank (directory mode 1733:
    ranks/<pid>.<hex>.sock    anyone may create, nobody may list or delete another's socket);
                              the second form when ``<pid>.sock`` was squatted by someone else
    daemon.sock               the daemon's, for acknowledgements
    agent.pid                 the torchrun agent's identity, written by ``sentinel launch``

Who counts as a rank (the daemon side): a file in ``ranks/`` is a rank only when it is a socket
(not a symlink, not a plain file), owned by the uid that owns ``/proc/<pid>``, and that process
descends from the agent recorded in ``agent.pid`` (see :mod:`sentinel.procs`). Anything else is
ignored and counted once (``sentinel_channel_rejected_total{reason}``); at most ``max_entries``
names are read from the directory per scan, so planted files cannot blind the daemon.
Acknowledgements are accepted only from the very ranks a request was sent to (kernel-verified
``SCM_CREDENTIALS`` pid, same start time); anyone else's are refused and counted.

Security (the rank side): every rank socket has ``SO_PASSCRED``, so each datagram carries
kernel-verified credentials (``SCM_CREDENTIALS``). A rank acts on a request only when it comes
from root or the daemon's configured uid; anything else is refused and counted. A malformed
message is ignored and counted. A rank whose socket name was squatted logs it once, binds the
alternative name and reports it in ``RankEndpoint.error``.

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
import secrets
import socket
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from sentinel import procs
from sentinel.families import counter

log = logging.getLogger("sentinel.channel")

VERSION = 1
REQUEST_TYPES = ("snapshot", "migrate")
MAX_MESSAGE = 4096
_UCRED = struct.Struct("3i")  # pid, uid, gid


def runtime_dir() -> Path:
    return Path(os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"))


def parse_rank_name(name: str) -> int | None:
    """The pid in a rank socket name (``<pid>.sock`` or ``<pid>.<hex>.sock``), else None."""
    parts = name.split(".")
    if parts[-1] != "sock" or len(parts) not in (2, 3):
        return None
    stem = parts[0]
    if not (stem.isascii() and stem.isdigit()) or len(stem) > 7 or stem.startswith("0"):
        return None
    if len(parts) == 3 and not (1 <= len(parts[1]) <= 32 and all(c in "0123456789abcdef" for c in parts[1])):
        return None
    pid = int(stem)
    return pid if pid > 1 else None


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

    def __init__(self, error: str = "") -> None:
        self.error = error

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
        self.error = ""
        ranks = directory / "ranks"
        self.path = ranks / f"{os.getpid()}.sock"
        try:
            self.sock = _bind_dgram(self.path, 0o622)  # the daemon (root) writes; others cannot read
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EACCES, errno.EADDRINUSE):
                raise
            # Someone else owns our name (sticky directory: we cannot remove it). Bind a name
            # nobody can predict; the daemon accepts both forms after verifying ownership.
            try:
                owner = os.lstat(self.path).st_uid
            except OSError:
                owner = -1
            self.error = f"control socket {self.path} is squatted by uid {owner}; using an alternative name"
            self.counts["squatted"] += 1
            log.error("%s", self.error)
            self.path = ranks / f"{os.getpid()}.{secrets.token_hex(8)}.sock"
            self.sock = _bind_dgram(self.path, 0o622)

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
        except OSError as exc:
            error = f"cannot bind a control socket in {directory / 'ranks'}: {exc.strerror}; no daemon requests will reach this rank"
            log.error("%s", error)
            return NullEndpoint(error)

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
@dataclass(frozen=True)
class RankInfo:
    pid: int
    start_time: int
    path: Path


@dataclass
class RequestState:
    request: Request
    sent_to: dict[int, int] = field(default_factory=dict)  # rank pid -> its start time
    staged: dict[int, Ack] = field(default_factory=dict)  # pid -> "staged" ack
    acks: dict[int, Ack] = field(default_factory=dict)  # pid -> "committed" ack


CHANNEL_MESSAGES = counter("sentinel_channel_messages", "Control-channel messages by kind and outcome", "kind", "outcome")
CHANNEL_REJECTED = counter("sentinel_channel_rejected",
                           "Control-channel datagrams refused (wrong sender, malformed, over a limit), by reason", "reason")


class DaemonEndpoint:
    """The daemon's end: sends requests to the node's verified ranks, collects their acknowledgements.

    ``agent`` returns the recorded torchrun agent (:class:`sentinel.procs.AgentRecord`) or
    raises (FileNotFoundError / :class:`sentinel.procs.NotTrusted`) when there is none to trust;
    by default it reads ``<directory>/agent.pid``. Without a trusted agent no file counts as a rank.
    """

    def __init__(self, directory: Path, *, agent: Callable[[], procs.AgentRecord] | None = None,
                 agent_pidfile: Path | None = None, max_ranks: int = 1024, proc: Path = procs.PROC) -> None:
        self.directory = directory
        self.ranks_dir = directory / "ranks"
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.ranks_dir, 0o1733)
        pidfile = agent_pidfile or directory / "agent.pid"
        self.agent = agent or (lambda: procs.read_agent_record(pidfile, proc=proc))
        self.max_ranks = max_ranks
        self.max_entries = 4 * max_ranks
        self.proc = proc
        self.sock = _bind_dgram(directory / "daemon.sock", 0o622)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self._rejected_seen: set[tuple[str, int, str]] = set()
        self.requests: dict[str, RequestState] = {}
        self.agent_error = ""

    # -- who is a rank -------------------------------------------------------------------------
    def _reject(self, name: str, ino: int, reason: str) -> None:
        key = (name, ino, reason)
        if key in self._rejected_seen:
            return
        if len(self._rejected_seen) > 65536:
            self._rejected_seen.clear()
        self._rejected_seen.add(key)
        self.rejected[reason] += 1
        if self.rejected[reason] == 1 or self.rejected[reason] % 1000 == 0:
            log.warning("ignored %d file(s) in %s (%s; last: %s)", self.rejected[reason], self.ranks_dir, reason, name)

    def ranks(self) -> dict[int, RankInfo]:
        """The verified ranks now: pid -> RankInfo. Never raises; reads at most ``max_entries`` names."""
        try:
            agent = self.agent()
            self.agent_error = ""
        except (OSError, procs.NotTrusted) as exc:
            error = "no agent pidfile" if isinstance(exc, FileNotFoundError) else str(exc)
            if error != self.agent_error:
                (log.info if isinstance(exc, FileNotFoundError) else log.warning)("no trusted agent: %s", error)
            self.agent_error = error
            agent = None
        out: dict[int, RankInfo] = {}
        try:
            it = os.scandir(self.ranks_dir)
        except OSError:
            return out
        with it:
            for n, entry in enumerate(it):
                if n >= self.max_entries or len(out) >= self.max_ranks:
                    self._reject("*", 0, "too_many_entries")
                    break
                name = entry.name
                try:
                    ino = entry.inode()
                except OSError:
                    continue
                pid = parse_rank_name(name)
                if pid is None:
                    self._reject(name, ino, "bad_name")
                    continue
                path = self.ranks_dir / name
                ok, reason = procs.is_socket_owned_by_process(path, pid, self.proc)
                if not ok:
                    if reason == "no_process":  # a socket (checked first) whose process exited
                        try:
                            path.unlink()
                            self.counts[("rank", "stale_removed")] += 1
                            continue
                        except OSError:
                            pass
                    if reason != "gone":
                        self._reject(name, ino, reason)
                    continue
                if agent is None:
                    self._reject(name, ino, "no_agent")
                    continue
                if not procs.descends_from(pid, agent.pid, agent.start_time, proc=self.proc):
                    self._reject(name, ino, "not_in_job")
                    continue
                try:
                    _, start = procs.proc_stat(pid, self.proc)
                except (ProcessLookupError, OSError, ValueError, IndexError):
                    continue
                if pid in out:  # two verified sockets of one rank: keep the canonical name
                    if name != f"{pid}.sock":
                        continue
                out[pid] = RankInfo(pid, start, path)
        return out

    def rank_pids(self) -> list[int]:
        return sorted(self.ranks())

    # -- requests and acknowledgements ----------------------------------------------------------
    def request(self, kind: str, request_id: str, reason: str, pids: list[int] | None = None,
                hold_seconds: float = 0.0) -> int:
        """Send to every verified local rank (or only those of ``pids``); returns how many
        received it. Re-sending the same id reaches the ranks again (a holding rank answers at once)."""
        req = Request(type=kind, id=request_id, reason=reason, hold_seconds=hold_seconds)
        state = self.requests.setdefault(request_id, RequestState(req))
        data = req.encode()
        ranks = self.ranks()
        targets = ranks.values() if pids is None else [ranks[p] for p in pids if p in ranks]
        for info in targets:
            try:
                self.sock.sendto(data, str(info.path))
                state.sent_to[info.pid] = info.start_time
                self.counts[(kind, "sent")] += 1
            except (ConnectionRefusedError, FileNotFoundError):
                self.counts[(kind, "stale_rank")] += 1
                info.path.unlink(missing_ok=True)
            except OSError as exc:
                self.counts[(kind, "error_" + errno.errorcode.get(exc.errno or 0, "unknown").lower())] += 1
        if len(self.requests) > 256:  # bounded: forget the oldest finished requests
            for rid in list(self.requests)[:-256]:
                del self.requests[rid]
        return len(state.sent_to)

    def poll_acks(self) -> list[Ack]:
        """Acknowledgements received since the last call, from the ranks each request was sent to."""
        out = []
        for _ in range(10000):  # bounded: a flood cannot keep the loop here
            got = _recv_with_creds(self.sock)
            if got is None:
                break
            data, pid, _uid = got
            try:
                msg = decode(data)
            except MalformedMessage:
                self.counts[("ack", "malformed")] += 1
                continue
            state = self.requests.get(msg.id) if isinstance(msg, Ack) else None
            if state is None or pid not in state.sent_to:
                self.counts[("ack", "refused")] += 1
                self.rejected["ack_not_expected"] += 1
                continue
            try:
                _, start = procs.proc_stat(pid, self.proc)
            except (ProcessLookupError, OSError, ValueError, IndexError):
                start = -1
            if start != state.sent_to[pid]:
                self.counts[("ack", "refused")] += 1
                self.rejected["ack_pid_reused"] += 1
                continue
            msg = Ack(**{**asdict(msg), "pid": pid})
            if msg.phase == "staged":
                state.staged[pid] = msg
                self.counts[("ack", "staged")] += 1
            else:
                state.acks[pid] = msg
                self.counts[("ack", "ok" if msg.ok else "error")] += 1
            out.append(msg)
        return out

    def complete(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        return bool(state and state.sent_to and set(state.sent_to) <= set(state.acks))

    FAMILIES = (CHANNEL_MESSAGES, CHANNEL_REJECTED)

    def metric_counters(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {CHANNEL_MESSAGES.key(kind=k, outcome=o): float(n) for (k, o), n in self.counts.items()}
        for reason, n in self.rejected.items():
            out[CHANNEL_REJECTED.key(reason=reason)] = float(n)
        return out

    def close(self) -> None:
        self.sock.close()
        (self.directory / "daemon.sock").unlink(missing_ok=True)


def send_raw(path: Path, data: bytes) -> None:
    """Send one datagram (tests and tools)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))

