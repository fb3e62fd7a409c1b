"""The daemon's end of the control channel (:mod:`sentinel.channel` holds the message format and
the rank's end): which files in ``ranks/`` are the node's verified ranks, the requests sent to
them and their acknowledgements, and agent registrations from launchers that are not root.
The trust rules are in :mod:`sentinel.channel`'s docstring and ``docs/security.md``."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sentinel import procs
from sentinel.ack_sockets import AckChannels, AckWatch
from sentinel.channel import (Ack, MalformedMessage, Register, Report, Request, _bind_dgram, _recv_with_creds,
                              decode, parse_rank_name)
from sentinel.families import counter

log = logging.getLogger("sentinel.channel")


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
        # each asked rank acknowledges on a socket pair of its own, its end handed over with the
        # request: no flood of daemon.sock can delay an ack (sentinel.ack_sockets)
        self.ack_channels = AckChannels()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.rejected: Counter[str] = Counter()
        self._rejected_seen: set[tuple[str, int, str]] = set()
        self.requests: dict[str, RequestState] = {}
        self._owing_until: dict[int, float] = {}  # rank pid -> until when it owes an acknowledgement (monotonic)
        self.agent_error = ""
        self.reports: list[Report] = []  # from verified ranks, taken by take_reports()
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
        self.ack_channels.keep_only({info.path.name for info in ranks.values()})
        for info in targets:
            self.ack_channels.ensure(info.path.name, (info.pid, info.start_time))
            state.sent_to[info.pid] = info.start_time
            state.unsent[info.pid] = info
        self._send_unsent(state)
        if len(self.requests) > 256:  # bounded: forget the oldest finished requests
            for rid in list(self.requests)[:-256]:
                del self.requests[rid]
        self._note_due()
        if self.ack_channels.watch is not None:
            self.ack_channels.watch.new_round()
        return len(state.sent_to)

    def _note_due(self) -> None:
        """Until when :class:`AckWatch` wakes the loop for each rank's pair: per rank pid that
        still owes an acknowledgement, the latest deadline of its requests (a new dict each time:
        the watch's thread only reads it)."""
        owing: dict[int, float] = {}
        for s in self.requests.values():
            for pid in s.sent_to.keys() - s.acks.keys():
                owing[pid] = max(owing.get(pid, 0.0), s.retry_until)
        self._owing_until = owing

    def _owes(self, fd: int) -> bool:
        pid = self.ack_channels.pid_of(fd)
        return pid is not None and self.clock() < self._owing_until.get(pid, 0.0)

    def watch_acks(self, wake: Callable[[], None]) -> None:
        """From now on ``wake`` is called (from a thread of its own) when an acknowledgement
        arrives on a rank's pair while one is due; the loop then reads it with :meth:`poll_acks`
        at once, not at its next poll."""
        if self.ack_channels.watch is None:
            self.ack_channels.watch = AckWatch(wake, self._owes)
            for sock in self.ack_channels.sockets():
                self.ack_channels.watch.add(sock)

    def _send_unsent(self, state: RequestState) -> None:
        kind = state.request.type
        data = state.request.encode()
        for pid, info in list(state.unsent.items()):
            hand_over = self.ack_channels.ancillary(info.path.name)  # the rank's ack channel, the first time
            try:
                if hand_over:
                    self.sock.sendmsg([data], hand_over, 0, str(info.path))
                else:
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
            if hand_over:
                self.ack_channels.handed(info.path.name)
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
        out: list[Ack] = []
        for sock in self.ack_channels.sockets():  # first: what a flood of daemon.sock cannot delay
            self._read_acks(sock, 64, out)
        self._read_acks(self.sock, 10000, out)
        self._note_due()
        return out

    def _read_acks(self, sock, limit: int, out: list[Ack]) -> None:
        for msg, pid, uid in self._messages(sock, limit, "ack"):
            if isinstance(msg, Register):
                self._register(pid, uid)
                continue
            if isinstance(msg, Report):
                self._accept_report(msg, pid)
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

    def _accept_report(self, report: Report, pid: int) -> None:
        """A report counts only from a verified rank of this node's job (the same test as a
        request's recipients); anyone else's is refused and counted. At most 256 are kept."""
        if pid not in self.ranks():
            self.counts[("report", "refused")] += 1
            self.rejected["report_not_a_rank"] += 1
            return
        self.counts[("report", report.kind)] += 1
        self.reports.append(dataclasses.replace(report, pid=pid))
        del self.reports[:-256]

    def take_reports(self) -> list[Report]:
        """The reports received since the last call (:meth:`poll_acks` reads them off the socket)."""
        out, self.reports = self.reports, []
        return out

    def _messages(self, sock, limit: int, kind: str):
        """(message, kernel pid, kernel uid) of each datagram waiting on ``sock``, at most ``limit``
        (a flood cannot keep the loop here); a malformed one is counted as ``(kind, "malformed")``."""
        for _ in range(limit):
            got = _recv_with_creds(sock)
            if got is None:
                return
            data, pid, uid = got
            try:
                yield decode(data), pid, uid
            except MalformedMessage:
                self.counts[(kind, "malformed")] += 1

    def _poll_registrations(self) -> None:
        """Read ``register.sock``: only registrations count there (an ack is refused). Bounded."""
        if self.register_sock is None:
            return
        for msg, pid, uid in self._messages(self.register_sock, 1000, "register"):
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
        if self.ack_channels.watch is not None:
            self.ack_channels.watch.close()
        self.ack_channels.close()
        self.sock.close()
        self.sock_path.unlink(missing_ok=True)
        if self.register_sock is not None:
            self.register_sock.close()
            self.register_path.unlink(missing_ok=True)


