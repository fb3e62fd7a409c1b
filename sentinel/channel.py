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
it once, binds the alternative name and reports it in ``RankEndpoint.error``. Acks go over the
rank's own acknowledgement channel when the daemon handed it one with a request (one end of a
socket pair, taken only from a daemon uid: :mod:`sentinel.ack_sockets`), past any flood of
``daemon.sock``; without one, acks that meet a full ``daemon.sock`` are retried. The boundaries and their tests: ``docs/security.md``.

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
import array
import select
import socket
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


log = logging.getLogger("sentinel.channel")

VERSION = 1
REQUEST_TYPES = ("snapshot", "migrate")
# What a rank reports to its node's daemon unasked (rank -> daemon): the job's own view of its
# health. "hang": the ranks that can still talk named a culprit on this node (or found none);
# "straggler": the job's progress exchange scored this node as slow. See sentinel.jobhealth.
# "rendezvous": the job's agent could not reach the rendezvous store (trainer.elastic).
REPORT_KINDS = ("hang", "straggler", "rendezvous")
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


@dataclass(frozen=True)
class Report:
    """A rank's unasked report to its node's daemon. ``detail`` is a flat JSON object (numbers,
    strings, lists of them); the daemon fills ``pid`` from the kernel-verified sender."""

    kind: str  # one of REPORT_KINDS
    rank: int
    step: int
    detail: dict = field(default_factory=dict)
    pid: int = 0
    type: str = "report"
    version: int = VERSION

    def encode(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:  # evidence is prose: cut it, never the figures
            detail = {k: (v[:200] if isinstance(v, str) else v) for k, v in self.detail.items()}
            data = json.dumps(asdict(Report(self.kind, self.rank, self.step, detail, self.pid)),
                              separators=(",", ":")).encode()
        return data


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


def decode(data: bytes) -> Request | Ack | Register | Report:
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
        if kind == "report":
            rep = Report(**{k: v for k, v in msg.items()})
            if rep.kind not in REPORT_KINDS or not isinstance(rep.detail, dict):
                raise MalformedMessage(f"report kind must be one of {', '.join(REPORT_KINDS)}, detail an object")
            if not (_int_in(rep.rank, 0, MAX_RANK) and _int_in(rep.step, -1, MAX_STEP) and _int_in(rep.pid, 0, MAX_RANK)):
                raise MalformedMessage("report rank, step or pid out of range")
            return rep
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


def _recv_request(sock: socket.socket) -> tuple[bytes, int, int, list[int]] | None:
    """(data, pid, uid, passed file descriptors) of the next datagram, or None when none is
    waiting. At most one descriptor is taken (the kernel closes any beyond it); close-on-exec."""
    try:
        data, ancdata, _flags, _addr = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(_UCRED.size)
                                                    + socket.CMSG_SPACE(array.array("i").itemsize),
                                                    socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        return None
    pid = uid = -1
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= _UCRED.size:
            pid, uid, _gid = _UCRED.unpack(payload[: _UCRED.size])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    return data, pid, uid, fds


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

    def report(self, report: Report) -> bool:
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
        self._ack_channel: socket.socket | None = None  # our end of the daemon's pair (sentinel.ack_sockets)
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
            got = _recv_request(self.sock)
            if got is None:
                return out
            data, pid, uid, fds = got
            if fds:
                self._take_channel(fds if uid in self.allowed_uids else [], fds)
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

    def _take_channel(self, take: list[int], received: list[int]) -> None:
        """Keep the first of ``take`` as the ack channel when it is a Unix datagram socket (it
        came from a daemon uid); close every other descriptor received."""
        for fd in received:
            if take and fd == take[0]:
                try:
                    sock = socket.socket(fileno=fd)
                except OSError:  # not a socket at all
                    os.close(fd)
                    self.counts["refused_descriptor"] += 1
                    continue
                if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_DGRAM:
                    sock.setblocking(False)
                    if self._ack_channel is not None:
                        self._ack_channel.close()
                    self._ack_channel = sock
                    self.counts["ack_channel"] += 1
                    continue
                sock.close()
            else:
                os.close(fd)
            self.counts["refused_descriptor"] += 1

    def _direct(self, data: bytes) -> bool:
        """Send on the ack channel the daemon handed us (:mod:`sentinel.ack_sockets`): its end is
        connected to ours, so the kernel takes the datagram at once whatever floods ``daemon.sock``,
        and nobody else can reach it. False when there is none or the send failed (the daemon that
        made it is gone: dropped, ``daemon.sock`` from then on); never blocks, never raises."""
        channel = self._ack_channel
        if channel is None:
            return False
        try:
            channel.send(data)
        except BlockingIOError:  # our own send buffer is full: the daemon is not reading its end
            self.counts["ack_channel_full"] += 1
            return False
        except OSError:
            channel.close()
            self._ack_channel = None
            self.counts["ack_channel_lost"] += 1
            return False
        return True

    def ack(self, ack: Ack) -> bool:
        """Send one acknowledgement: on this rank's own ack channel when the daemon handed it one
        (one non-blocking send no flood can delay), else on ``daemon.sock``, where a full queue
        (EAGAIN: someone floods it) is waited out, up to ``ack_timeout`` seconds in all; True
        once the daemon has it."""
        data = ack.encode()
        if self._direct(data):
            self.counts["ack_direct"] += 1
            return True
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

    def report(self, report: Report) -> bool:
        """Tell this node's daemon something unasked (a hang verdict, a straggler score)."""
        if self._direct(report.encode()):
            return True
        try:
            self.sock.sendto(report.encode(), str(self.directory / "daemon.sock"))
            return True
        except OSError:
            self.counts["report_failed"] += 1
            return False

    def close(self) -> None:
        if self._ack_channel is not None:
            self._ack_channel.close()
        self.sock.close()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------
# Daemon side
def send_raw(path: Path, data: bytes) -> None:
    """Send one datagram (tests and tools)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))

