"""The daemon <-> trainer control channel: one versioned message format over Unix datagrams.

Layout under ``SENTINEL_RUNTIME_DIR`` (default ``/run/sentinel``, root-owned, mode 0755)::

    ranks/<pid>.sock          one per training rank, bound by the rank (directory mode 1733:
    ranks/<pid>.<hex>.sock    anyone may create, nobody may list or delete another's socket);
                              the second form when ``<pid>.sock`` was squatted by someone else.
                              0600 plus an ACL entry for the daemon's uid (its unit keeps no
                              CAP_DAC_OVERRIDE), and connected to daemon.sock (below)
    daemon.sock               the daemon's, for acknowledgements: 0600 root until an agent is
                              trusted, then root:<the agent's gid> 0660
    register.sock             agent registrations from launchers that are not root (0622:
                              anyone may send; only with ``actions.agent_registration``)
    agent.pid                 the torchrun agent's identity, written by ``sentinel launch`` as
                              root, or by the daemon for a launcher that registered

Who counts as a rank (the daemon side): a file in ``ranks/`` is a rank only when it is a socket
(not a symlink, not a plain file), owned by the uid that owns ``/proc/<pid>``, and that process
descends from the agent recorded in ``agent.pid`` (see :mod:`sentinel.procs`). Every process's
``<pid>.sock`` is looked up by name, so no number of planted files can hide a rank; a bounded
scan (``max_entries`` names) finds the alternative names and removes junk (never through a
link). What is not a rank is counted once (``sentinel_channel_rejected_total{reason}``).
Acknowledgements are accepted only from the very ranks a request was sent to (kernel-verified
``SCM_CREDENTIALS`` pid, same start time); anyone else's are refused and counted. A send the
kernel refuses for now (EAGAIN, EPERM) keeps the rank as asked and is retried until the
request's deadline. Every datagram is bounded and range-checked (:func:`decode`).

Agent registration: a launcher that is not root (an ordinary user's Slurm job, a non-root pod)
cannot write the root-owned ``agent.pid``; it sends a ``register`` datagram to ``register.sock``
instead (a socket of its own, so that registrations never share ``daemon.sock``'s queue
with the acks, and ``daemon.sock`` stays closed to everyone but the job). The daemon takes the sender's pid from the kernel (``SCM_CREDENTIALS``, in the daemon's
own pid namespace: a pod's agent arrives with its host pid), never from the message; records it
only when the sender is a job process of an accepted kind (:func:`sentinel.procs.job_origin`,
``actions.agent_registration``) and no live agent of another user is recorded; and writes the
record itself, as root. Every outcome is counted (``sentinel_channel_messages_total{kind="register"}``).

Security (the rank side): each rank's socket is *connected* to ``daemon.sock``, so the kernel
refuses every datagram to it that is not the daemon's (even from the job's own user) and lets the
daemon's past a full receive queue. Every rank socket has ``SO_PASSCRED`` as well, so each
datagram carries kernel-verified credentials (``SCM_CREDENTIALS``): a rank acts on a request
only when it comes from root or the daemon's configured uid; anything else is refused and
counted. A malformed message is ignored and counted. A rank whose socket name was squatted logs
it once, binds the alternative name and reports it in ``RankEndpoint.error``. Acks that meet a
full ``daemon.sock`` are retried. The boundaries and their tests: ``docs/security.md``.

Cost: :meth:`RankEndpoint.poll` is one non-blocking ``recvmsg`` returning EAGAIN when idle
(about a microsecond). With no runtime directory (no daemon installed) the rank gets a
:class:`NullEndpoint` that does nothing. A daemon restart changes nothing for a running job: the
rank sockets stay where they are and the new daemon finds them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import select
import socket
import stat
import struct
import time
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


# Bounds on what a rank may claim in an ack: a snapshot of one rank above MAX_ACK_BYTES, or a step
# or rank number outside a 63/31-bit integer, is not a number a trainer produces; the ack is malformed.
MAX_ACK_BYTES = 1 << 42  # 4 TiB of state on one rank
MAX_STEP = (1 << 63) - 1
MAX_RANK = (1 << 31) - 1
MAX_NESTING = 64  # "[" and "{" in one datagram; a v1 message has one "{" (plus any inside strings)
_ACK_STR_FIELDS = ("id", "path", "error", "request_type", "phase", "type")


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == value and 0 <= value < 1e6)  # value == value: not NaN


@dataclass(frozen=True)
class Register:
    """A launcher asks the daemon to record it as the node's agent (it is the agent's parent and
    forwards signals to it). The pid is the kernel's, from the datagram's credentials."""

    type: str = "register"
    version: int = VERSION

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def register(directory: Path) -> None:
    """Ask the daemon whose runtime directory is ``directory`` to record this process as the
    agent (one datagram to ``register.sock``; raises OSError when no daemon listens)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.sendto(Register().encode(), str(directory / "register.sock"))


def decode(data: bytes) -> Request | Ack | Register:
    """Parse one datagram; raises MalformedMessage for anything not exactly a v1 message: too
    long, nested (refused before the parser recurses), not UTF-8, a field of the wrong type, or
    a number out of range (bytes, step, rank, seconds). Never raises anything else."""
    if len(data) > MAX_MESSAGE:
        raise MalformedMessage("message too long")
    if data.count(b"[") + data.count(b"{") > MAX_NESTING:
        raise MalformedMessage("too many brackets for a flat message")
    try:
        msg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise MalformedMessage(f"not JSON: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or msg.get("version") != VERSION or isinstance(msg.get("version"), bool):
        raise MalformedMessage("not a version-1 message")
    kind = msg.get("type")
    try:
        if kind in REQUEST_TYPES:
            if not isinstance(msg.get("id"), str) or not isinstance(msg.get("reason", ""), str) or not msg["id"]:
                raise MalformedMessage("request needs a string id and reason")
            hold = msg.get("hold_seconds", 0.0)
            if not _seconds(hold):
                raise MalformedMessage("hold_seconds must be a number of seconds")
            return Request(type=kind, id=msg["id"], reason=msg.get("reason", ""), hold_seconds=float(hold))
        if kind == "ack":
            ack = Ack(**{k: v for k, v in msg.items()})
            if not all(isinstance(getattr(ack, k), str) for k in _ACK_STR_FIELDS) or not isinstance(ack.ok, bool):
                raise MalformedMessage("ack fields of the wrong type")
            if not (_int_in(ack.step, -1, MAX_STEP) and _int_in(ack.rank, 0, MAX_RANK) and _int_in(ack.pid, 0, MAX_RANK)
                    and _seconds(ack.blocked_seconds)):
                raise MalformedMessage("ack step, rank, pid or blocked_seconds out of range")
            if ack.phase not in ("staged", "committed"):
                raise MalformedMessage("ack phase must be staged or committed")
            if not _int_in(ack.bytes, 0, MAX_ACK_BYTES):
                raise MalformedMessage(f"ack bytes must be an integer from 0 to {MAX_ACK_BYTES}")
            return ack
        if kind == "register":
            if set(msg) != {"type", "version"}:
                raise MalformedMessage("register carries no fields")
            return Register()
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


_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def _writable_by(path: Path, uids: frozenset[int]) -> None:
    """Give ``path`` the POSIX ACL ``u::rw-,u:<uid>:-w- (each of uids),g::---,m::-w-,o::---``:
    its owner and those uids may send to it, nobody else. Needed because the daemon's unit keeps
    no CAP_DAC_OVERRIDE: root is just another uid to a 0600 file. Raises OSError (EOPNOTSUPP on a
    filesystem without ACLs)."""
    entries = [(_ACL_USER_OBJ, 6, _ACL_UNDEFINED_ID)]
    entries += [(_ACL_USER, 2, uid) for uid in sorted(uids)]
    entries += [(_ACL_GROUP_OBJ, 0, _ACL_UNDEFINED_ID), (_ACL_MASK, 2, _ACL_UNDEFINED_ID),
                (_ACL_OTHER, 0, _ACL_UNDEFINED_ID)]
    blob = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.setxattr(path, "system.posix_acl_access", blob, follow_symlinks=False)


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
    """A training rank's end: receives requests (verified sender), sends acknowledgements.

    The socket file is mode 0600 with an ACL entry for the daemon's uid (root or
    ``SENTINEL_DAEMON_UID``: the daemon's unit keeps no CAP_DAC_OVERRIDE), and the socket is
    *connected* to ``daemon.sock``: the kernel then refuses every datagram to it that does not
    come from the daemon's socket (EPERM for the sender), and the daemon's own datagrams skip
    the receive-queue limit, so nobody — not even the job's user — can fill the queue the
    daemon's request must enter. The connection is renewed every ``reconnect_seconds`` in
    :meth:`poll` (a restarted daemon has a new socket). :meth:`ack` retries a send the daemon's
    full queue refused (EAGAIN) until ``ack_timeout`` has passed."""

    active = True

    def __init__(self, directory: Path, *, allowed_uids: frozenset[int] = frozenset({0}),
                 ack_timeout: float = 10.0, reconnect_seconds: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.allowed_uids = allowed_uids
        self.ack_timeout = ack_timeout
        self.reconnect_seconds = reconnect_seconds
        self.clock = clock
        self.counts: Counter[str] = Counter()
        self.error = ""
        self.connected = False
        self._next_connect = 0.0
        ranks = directory / "ranks"
        self.path = ranks / f"{os.getpid()}.sock"
        try:
            self.sock = self._bind(self.path)
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
            self.sock = self._bind(self.path)
        self._connect()

    def _bind(self, path: Path) -> socket.socket:
        """Bind ``path`` 0600 plus an ACL entry for each daemon uid (root keeps no
        CAP_DAC_OVERRIDE in its unit). On a filesystem without ACLs the file is 0622 (the old
        way): the connection to ``daemon.sock`` still makes the kernel refuse everyone else."""
        sock = _bind_dgram(path, 0o600)
        others = self.allowed_uids - {os.geteuid()}
        if not others:
            return sock  # the rank runs as the daemon's uid: 0600 is all it takes
        try:
            _writable_by(path, others)
        except OSError as exc:
            os.chmod(path, 0o622)
            self.counts["acl_unsupported"] += 1
            log.warning("cannot set an ACL on %s (%s); it is open to every local user until the daemon connects",
                        path, exc.strerror or exc)
        return sock

    def _connect(self) -> None:
        """Connect to the daemon's socket (only it may send to us then); never raises."""
        self._next_connect = self.clock() + self.reconnect_seconds
        try:
            self.sock.connect(str(self.directory / "daemon.sock"))
        except OSError:
            self.connected = False  # no daemon yet (or not ours to reach): tried again at the next poll
            return
        if not self.connected:
            self.counts["connected"] += 1
        self.connected = True

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

    def poll(self, limit: int = 256) -> list[Request]:
        """Non-blocking: the requests waiting now (usually none); reads at most ``limit`` datagrams."""
        if self.clock() >= self._next_connect:
            self._connect()
        out: list[Request] = []
        for _ in range(limit):
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
        return out

    def ack(self, ack: Ack) -> bool:
        """Send one acknowledgement. A full daemon queue (EAGAIN: someone floods ``daemon.sock``)
        is waited out, up to ``ack_timeout`` seconds in all; True once the daemon has it."""
        data = ack.encode()
        target = str(self.directory / "daemon.sock")
        deadline = self.clock() + self.ack_timeout
        pause = 0.001
        while True:
            try:
                self.sock.sendto(data, target)
                return True
            except (BlockingIOError, InterruptedError):
                self.counts["ack_retried"] += 1
            except ConnectionRefusedError:  # our connected daemon socket is gone: a restarted daemon
                self._connect()
                self.counts["ack_retried"] += 1
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    self.counts["ack_failed"] += 1
                    log.warning("acknowledgement %s not sent: %s", ack.id, exc.strerror or exc)
                    return False
                self.counts["ack_retried"] += 1
            left = deadline - self.clock()
            if left <= 0:
                self.counts["ack_failed"] += 1
                log.error("acknowledgement %s not sent: the daemon's socket stayed full for %.0f s",
                          ack.id, self.ack_timeout)
                return False
            if not self.connected:
                self._connect()
            if self.connected:  # connected: POLLOUT says when the daemon's queue has room
                waiter = select.poll()
                waiter.register(self.sock, select.POLLOUT)
                waiter.poll(max(1, int(min(left, 0.05) * 1000)))
            else:
                time.sleep(min(left, pause))
                pause = min(0.05, pause * 2)

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
    sent_to: dict[int, int] = field(default_factory=dict)  # rank pid -> its start time (sent or still to send)
    staged: dict[int, Ack] = field(default_factory=dict)  # pid -> "staged" ack
    acks: dict[int, Ack] = field(default_factory=dict)  # pid -> "committed" ack
    unsent: dict[int, RankInfo] = field(default_factory=dict)  # refused for now (EAGAIN, EPERM): retried
    retry_until: float = 0.0  # monotonic


# A send to a rank that failed for now: its queue was full (only before the rank connected to
# this daemon's socket), it is still connected to a previous daemon's socket (EPERM until its
# next poll reconnects), or the kernel had no buffer. Retried until the request's deadline.
_RETRY_ERRNOS = frozenset({errno.EAGAIN, errno.EPERM, errno.ENOBUFS, errno.EINTR})
# What the daemon removes from ranks/ (never a directory that is not empty, never through a link).
_JUNK = frozenset({"bad_name", "not_socket", "no_process", "owner_mismatch", "not_in_job"})


CHANNEL_MESSAGES = counter("sentinel_channel_messages", "Control-channel messages by kind and outcome", "kind", "outcome")
CHANNEL_REJECTED = counter("sentinel_channel_rejected",
                           "Control-channel datagrams refused (wrong sender, malformed, over a limit), by reason", "reason")


class DaemonEndpoint:
    """The daemon's end: sends requests to the node's verified ranks, collects their acknowledgements.

    ``agent`` returns the recorded torchrun agent (:class:`sentinel.procs.AgentRecord`) or
    raises (FileNotFoundError / :class:`sentinel.procs.NotTrusted`) when there is none to trust;
    by default it reads ``<directory>/agent.pid``. Without a trusted agent no file counts as a rank.

    ``daemon.sock`` is mode 0600 until an agent is trusted, then ``root:<the agent's gid>`` 0660:
    only the job's user and group (and root) can reach it.
    """

    def __init__(self, directory: Path, *, agent: Callable[[], procs.AgentRecord] | None = None,
                 agent_pidfile: Path | None = None, max_ranks: int = 1024, proc: Path = procs.PROC,
                 clock: Callable[[], float] = time.monotonic, registration: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.ranks_dir = directory / "ranks"
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.ranks_dir, 0o1733)
        self.pidfile = agent_pidfile or directory / "agent.pid"
        self._mapped: dict = {}  # the last pod agent's host pid (procs.read_agent_record)
        self._rank_pids: dict[tuple[int, int], int] = {}  # (pid namespace, its pid) -> host pid
        self._pod_scan: tuple[int, float, dict[int, int]] = (0, 0.0, {})  # (namespace, when, its pids)
        self.agent = agent or (lambda: procs.read_agent_record(self.pidfile, proc=proc, mapped=self._mapped))
        self.registration = tuple(registration)
        self.max_ranks = max_ranks
        self.max_entries = 4 * max_ranks
        self.proc = proc
        self.clock = clock
        self.sock_path = directory / "daemon.sock"
        self.sock = _bind_dgram(self.sock_path, 0o600)
        # registrations have a socket of their own: anyone may send to it (a launcher that is not
        # root, before any agent is trusted), and a flood of it never fills daemon.sock's queue
        self.register_path = directory / "register.sock"
        self.register_sock = _bind_dgram(self.register_path, 0o622) if self.registration else None
        self.counts: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self._rejected_seen: set[tuple[str, int, str]] = set()
        self.requests: dict[str, RequestState] = {}
        self.agent_error = ""
        self._granted: tuple[int, int] | None = None
        # The last complete scan: the directory's mtime and agent then, and the alternative names
        # it verified. While neither changed, only those names are verified again (cheap).
        self._scanned: tuple[int, tuple[int, int] | None] | None = None
        self._alternatives: dict[str, int] = {}
        self._kept: set[tuple[str, int]] = set()  # junk that could not be removed: not tried again
        self._removal_budget = 0  # removals left in this scan: at most max_ranks per call
        try:
            self._grant(self.agent())
        except (OSError, procs.NotTrusted):
            pass

    # -- who may reach daemon.sock -------------------------------------------------------------
    def _grant(self, agent: procs.AgentRecord) -> None:
        """``daemon.sock`` becomes root:<the agent's gid> 0660 (once per agent). Never raises."""
        key = (agent.pid, agent.start_time)
        if self._granted == key:
            return
        try:
            gid = procs.proc_gid(agent.pid, self.proc)
            if os.geteuid() == 0:
                os.chown(self.sock_path, 0, gid, follow_symlinks=False)
            os.chmod(self.sock_path, 0o660)
        except (OSError, ValueError, ProcessLookupError) as exc:
            log.warning("cannot open %s to the job's group: %s", self.sock_path, exc)
            return
        self._granted = key

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

    def _remove(self, dfd: int, name: str, is_dir: bool, ino: int = 0) -> bool:
        """Remove one junk entry of ``ranks/`` (the entry itself: unlink never follows a link;
        a directory only when empty). Counted; never raises."""
        if (name, ino) in self._kept or self._removal_budget <= 0:
            return False
        self._removal_budget -= 1
        try:
            if is_dir:
                os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return True
        except OSError:
            self.counts[("rank", "junk_kept")] += 1
            if len(self._kept) > 65536:
                self._kept.clear()
            self._kept.add((name, ino))
            return False
        self.counts[("rank", "junk_removed")] += 1
        return True

    def _verify(self, dfd: int, name: str, pid: int, agent: procs.AgentRecord | None) -> tuple[RankInfo | None, str, int, bool]:
        """(RankInfo or None, why not, inode, is a directory) for one entry of ``ranks/``."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None, "gone", 0, False
        if stat.S_ISDIR(st.st_mode):
            return None, "not_socket", st.st_ino, True
        if not stat.S_ISSOCK(st.st_mode):
            return None, "not_socket", st.st_ino, False
        try:
            uid = procs.proc_uid(pid, self.proc)
        except ProcessLookupError:
            return None, "no_process", st.st_ino, False
        if st.st_uid != uid:
            return None, "owner_mismatch", st.st_ino, False
        if agent is None:
            return None, "no_agent", st.st_ino, False
        if not procs.descends_from(pid, agent.pid, agent.start_time, proc=self.proc):
            return None, "not_in_job", st.st_ino, False
        try:
            _, start = procs.proc_stat(pid, self.proc)
        except (ProcessLookupError, OSError, ValueError, IndexError):
            return None, "gone", st.st_ino, False
        return RankInfo(pid, start, self.ranks_dir / name), "", st.st_ino, False

    def _process_pids(self) -> list[int]:
        try:
            with os.scandir(self.proc) as it:
                return [int(e.name) for e in it if e.name.isdigit()]
        except OSError:
            return []

    def ranks(self) -> dict[int, RankInfo]:
        """The verified ranks now: pid -> RankInfo. Never raises.

        Two passes, so that nothing else in the directory can hide a rank: (1) for every process
        on the node, its canonical ``<pid>.sock`` is looked up by name (planted files are never
        in the way); (2) at most ``max_entries`` directory entries are read for the alternative
        names (``<pid>.<hex>.sock``) and for junk, which is removed: anything that is not a
        socket (a directory only when empty), a bad name, a socket whose process is gone or
        owned by another uid, or — with a trusted agent — not the job's; at most ``max_ranks``
        removals per call. While the directory and the agent are unchanged since a complete scan,
        only the alternative names it found are verified again."""
        try:
            agent = self.agent()
            self.agent_error = ""
            self._grant(agent)
        except (OSError, procs.NotTrusted) as exc:
            error = "no agent pidfile" if isinstance(exc, FileNotFoundError) else str(exc)
            if error != self.agent_error:
                (log.info if isinstance(exc, FileNotFoundError) else log.warning)("no trusted agent: %s", error)
            self.agent_error = error
            agent = None
        out: dict[int, RankInfo] = {}
        self._removal_budget = self.max_ranks
        # an agent in a pod: its ranks name their sockets by their pids in the pod's namespace
        own_ns = procs.pid_namespace("self", self.proc)
        pod_ns = agent.pidns if agent is not None and agent.pidns and agent.pidns != own_ns else 0
        if not pod_ns:
            self._rank_pids.clear()
        try:
            dfd = os.open(self.ranks_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return out
        try:
            if agent is not None:
                # (name's pid, host pid): a pod's ranks name their sockets by their pids in the pod
                pids = self._pod_pids(pod_ns) if pod_ns else ((pid, pid) for pid in self._process_pids())
                for named, pid in pids:
                    if len(out) >= self.max_ranks:
                        break
                    if pid <= 1:
                        continue
                    name = f"{named}.sock"
                    try:
                        os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        continue  # the usual case: this process is not a rank
                    self._consider(dfd, name, pid, agent, out, named)
            try:
                mtime = os.fstat(dfd).st_mtime_ns
            except OSError:
                mtime = -1
            state = (mtime, (agent.pid, agent.start_time) if agent else None)
            if self._scanned == state:
                for name, pid in list(self._alternatives.items()):
                    self._consider(dfd, name, pid, agent, out)
            else:
                self._alternatives = {}
                complete = self._scan(dfd, agent, out, pod_ns)
                # a change within the filesystem's timestamp granularity would leave the mtime as it
                # was: only a directory left alone for a second stands for what was read
                self._scanned = state if complete and time.time_ns() - mtime > 1_000_000_000 else None
        finally:
            os.close(dfd)
        return out

    def _scan(self, dfd: int, agent: procs.AgentRecord | None, out: dict[int, RankInfo], pod_ns: int = 0) -> bool:
        """Read at most ``max_entries`` entries; True when that was all of them and nothing was
        removed (the directory's mtime then stands for what was read)."""
        removed = self.counts[("rank", "junk_removed")] + self.counts[("rank", "stale_removed")]
        try:
            it = os.scandir(dfd)
        except OSError:
            return False
        with it:
            for n, entry in enumerate(it):
                if n >= self.max_entries:
                    self._reject("*", 0, "too_many_entries")
                    return False
                name = entry.name
                pid = parse_rank_name(name)
                if pid is None:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                        ino = entry.inode()
                    except OSError:
                        continue
                    self._reject(name, ino, "bad_name")
                    self._remove(dfd, name, is_dir, ino)
                    continue
                named = pid
                if pod_ns:
                    mapped = self._pod_rank(pid, pod_ns)
                    if mapped is None:  # no process of the pod has that pid: not (or no longer) a rank
                        self._reject(name, 0, "not_in_job")
                        continue
                    pid = mapped
                if pid in out and out[pid].path.name == name:
                    continue  # found by name in the first pass
                self._consider(dfd, name, pid, agent, out, named)
                if pid in out and out[pid].path.name == name and name != f"{named}.sock":
                    self._alternatives[name] = pid
        return removed == self.counts[("rank", "junk_removed")] + self.counts[("rank", "stale_removed")]

    def _consider(self, dfd: int, name: str, pid: int, agent: procs.AgentRecord | None,
                  out: dict[int, RankInfo], named: int | None = None) -> None:
        """Verify one entry (``pid`` the host pid, ``named`` the pid its name carries: the same
        but for a pod's rank): add it to ``out``, or count why not and remove it when it is junk."""
        info, why, ino, is_dir = self._verify(dfd, name, pid, agent)
        if info is not None:
            # two verified sockets of one rank: the canonical name wins
            if len(out) < self.max_ranks and (pid not in out or name == f"{pid if named is None else named}.sock"):
                out[pid] = info
            return
        if why == "gone":
            return
        if why == "no_process" and not is_dir:  # a socket whose process exited
            if self._remove(dfd, name, False):
                self.counts[("rank", "stale_removed")] += 1
            return
        self._reject(name, ino, why)
        if why in _JUNK:
            self._remove(dfd, name, is_dir, ino)

    def _pod_pids(self, pod_ns: int) -> list[tuple[int, int]]:
        """(pid in the pod, host pid) of the pod's processes, from one scan of ``/proc`` made at
        most once every ``procs.REMAP_SECONDS``."""
        now = time.monotonic()
        if self._pod_scan[0] != pod_ns or now - self._pod_scan[1] >= procs.REMAP_SECONDS:
            self._pod_scan = (pod_ns, now, procs.pids_in_namespace(pod_ns, self.proc))
        return sorted(self._pod_scan[2].items())

    def _pod_rank(self, nspid: int, pod_ns: int) -> int | None:
        """The host pid of the pod's process ``nspid``: the one found before when it still is that
        process, else from one scan of ``/proc`` for the whole pod, made at most once every
        ``procs.REMAP_SECONDS`` (names no process of the pod has, planted or stale, cannot make
        every poll scan)."""
        known = self._rank_pids.get((pod_ns, nspid))
        if known is not None and procs.in_namespace(known, nspid, pod_ns, self.proc):
            return known
        now = time.monotonic()
        if self._pod_scan[0] != pod_ns or now - self._pod_scan[1] >= procs.REMAP_SECONDS:
            self._pod_scan = (pod_ns, now, procs.pids_in_namespace(pod_ns, self.proc))
        found = self._pod_scan[2].get(nspid)
        if found is None or not procs.in_namespace(found, nspid, pod_ns, self.proc):
            return None
        if len(self._rank_pids) > 4 * self.max_ranks:
            self._rank_pids.clear()
        self._rank_pids[(pod_ns, nspid)] = found
        return found

    def rank_pids(self) -> list[int]:
        return sorted(self.ranks())

    # -- requests and acknowledgements ----------------------------------------------------------
    def request(self, kind: str, request_id: str, reason: str, pids: list[int] | None = None,
                hold_seconds: float = 0.0, retry_seconds: float = 120.0) -> int:
        """Send to every verified local rank (or only those of ``pids``); returns how many ranks
        were asked. A send the kernel refused for now (a full queue, a rank still connected to a
        previous daemon) is retried at each :meth:`poll_acks` for ``retry_seconds``: a rank is
        never taken for unreachable while it is there. Re-sending the same id reaches the ranks
        again (a holding rank answers at once)."""
        req = Request(type=kind, id=request_id, reason=reason, hold_seconds=hold_seconds)
        state = self.requests.setdefault(request_id, RequestState(req))
        state.request = req
        state.retry_until = max(state.retry_until, self.clock() + retry_seconds)
        ranks = self.ranks()
        targets = ranks.values() if pids is None else [ranks[p] for p in pids if p in ranks]
        for info in targets:
            state.sent_to[info.pid] = info.start_time
            state.unsent[info.pid] = info
        self._send_unsent(state)
        if len(self.requests) > 256:  # bounded: forget the oldest finished requests
            for rid in list(self.requests)[:-256]:
                del self.requests[rid]
        return len(state.sent_to)

    def _send_unsent(self, state: RequestState) -> None:
        kind = state.request.type
        data = state.request.encode()
        for pid, info in list(state.unsent.items()):
            try:
                self.sock.sendto(data, str(info.path))
            except (ConnectionRefusedError, FileNotFoundError):
                self.counts[(kind, "stale_rank")] += 1
                info.path.unlink(missing_ok=True)
                state.sent_to.pop(pid, None)
                del state.unsent[pid]
                continue
            except OSError as exc:
                if exc.errno in _RETRY_ERRNOS and self.clock() < state.retry_until:
                    self.counts[(kind, "retried")] += 1
                    continue
                self.counts[(kind, "error_" + errno.errorcode.get(exc.errno or 0, "unknown").lower())] += 1
                del state.unsent[pid]
                continue
            self.counts[(kind, "sent")] += 1
            del state.unsent[pid]

    def retry_pending(self) -> None:
        """Send again what the kernel refused for now (see :meth:`request`). Never raises."""
        for state in self.requests.values():
            if state.unsent:
                self._send_unsent(state)

    def poll_acks(self) -> list[Ack]:
        """Acknowledgements received since the last call, from the ranks each request was sent
        to. Retries pending sends first. A datagram that is not a valid ack (too long, nested,
        out of range) is counted as malformed and skipped; the others of the batch are kept."""
        self.retry_pending()
        self._poll_registrations()
        out = []
        for _ in range(10000):  # bounded: a flood cannot keep the loop here
            got = _recv_with_creds(self.sock)
            if got is None:
                break
            data, pid, uid = got
            try:
                msg = decode(data)
            except MalformedMessage:
                self.counts[("ack", "malformed")] += 1
                continue
            if isinstance(msg, Register):
                self._register(pid, uid)
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
            msg = dataclasses.replace(msg, pid=pid)
            if msg.phase == "staged":
                state.staged[pid] = msg
                self.counts[("ack", "staged")] += 1
            else:
                state.acks[pid] = msg
                self.counts[("ack", "ok" if msg.ok else "error")] += 1
            out.append(msg)
        return out

    def _poll_registrations(self) -> None:
        """Read ``register.sock``: only registrations count there (an ack is refused). Bounded."""
        if self.register_sock is None:
            return
        for _ in range(1000):
            got = _recv_with_creds(self.register_sock)
            if got is None:
                return
            data, pid, uid = got
            try:
                msg = decode(data)
            except MalformedMessage:
                self.counts[("register", "malformed")] += 1
                continue
            if not isinstance(msg, Register):
                self.counts[("register", "refused_not_register")] += 1
                continue
            self._register(pid, uid)

    def _register(self, pid: int, uid: int) -> None:
        """A launcher asked to be recorded as the agent; ``pid``/``uid`` are the kernel's."""
        def refuse(reason: str, why: str) -> None:
            self.counts[("register", reason)] += 1
            n = self.counts[("register", reason)]
            if n == 1 or n % 100 == 0:  # a flood of registrations is counted, not logged line by line
                log.warning("agent registration from pid %d (uid %d) refused (%d so far): %s", pid, uid, n, why)

        if pid <= 1:
            refuse("refused_no_pid", "the kernel gave no pid for the sender (another pid namespace than the "
                                     "daemon's: run the daemon with hostPID)")
            return
        try:
            origin = procs.job_origin(pid, self.registration, proc=self.proc)
            record = dataclasses.replace(procs.AgentRecord.of(pid, self.proc),
                                         pidns=procs.pid_namespace("self", self.proc))
        except procs.NotTrusted as exc:
            refuse("refused_not_a_job", str(exc))
            return
        except (ProcessLookupError, OSError, ValueError, IndexError):
            refuse("refused_gone", "it exited before it could be recorded")
            return
        if record.uid != uid:
            refuse("refused_uid", f"it runs as uid {record.uid} now")
            return
        try:
            current = self.agent()
        except (OSError, procs.NotTrusted):
            current = None
        if current is not None and current.pid != pid and current.uid != uid:
            refuse("refused_busy", f"the live agent pid {current.pid} of uid {current.uid} is recorded")
            return
        try:
            procs.write_agent_record(self.pidfile, record)
        except OSError as exc:
            refuse("refused_write_failed", f"cannot write {self.pidfile}: {exc}")
            return
        self.counts[("register", "ok")] += 1
        log.info("agent recorded: pid %d (uid %d), a %s job process, registered over %s", pid, uid, origin,
                 self.register_path)

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
        self.sock_path.unlink(missing_ok=True)
        if self.register_sock is not None:
            self.register_sock.close()
            self.register_path.unlink(missing_ok=True)


def send_raw(path: Path, data: bytes) -> None:
    """Send one datagram (tests and tools)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))

