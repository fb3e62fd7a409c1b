"""Processes the daemon may act on, identified so that a pid alone is never trusted.

A process is named by ``(pid, start_time)``: the start time (``/proc/<pid>/stat`` field 22, in
clock ticks since boot) never repeats for a reused pid within one boot. The torchrun agent that
``sentinel launch`` starts is recorded in the agent pidfile as such an identity plus its
executable and uid; the daemon signals it only when all of them still match, and through a
pidfd, so a pid reused between the check and the signal cannot be hit.

Job membership (who counts as a training rank): a process is in the job when it descends from
the recorded agent (torchrun's workers are its children). Membership is checked by walking the
``PPid`` chain in ``/proc``; a process that was reparented (its agent died) is no longer in the
job, which is what we want.

Pid namespaces (a training pod; the daemon runs with ``hostPID``): a record written inside a
pod names the agent by its pid *in the pod* and carries the inode of that pid namespace
(``pidns``). The daemon never signals that number as a host pid: it finds the one host process
that is in that very namespace with that namespace pid (``NSpid`` in ``/proc/<pid>/status``) and
then checks it as any other (start time, executable, uid) before trusting it
(:func:`host_pid`). Rank sockets named by namespace pids are mapped the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sentinel.fsutil import UnsafePath, read_trusted, write_atomic

PROC = Path("/proc")
# a pod's agent or rank not found in /proc is looked for again after this long, not at every read
REMAP_SECONDS = 1.0


class NotTrusted(RuntimeError):
    """The pidfile or process must not be acted on; the message says why (one sentence)."""


def _stat_fields(pid: int, proc: Path) -> list[bytes]:
    """/proc/<pid>/stat from the state field on; raises ProcessLookupError when it does not exist."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    # "pid (comm) state ppid ..." — comm may contain spaces and parentheses: split at the last ')'
    return raw[raw.rindex(b")") + 2:].split()


def proc_stat(pid: int, proc: Path = PROC) -> tuple[int, int]:
    """(ppid, start_time) of ``pid``; raises ProcessLookupError when it does not exist."""
    rest = _stat_fields(pid, proc)
    return int(rest[1]), int(rest[19])


def running(pid: int, proc: Path = PROC) -> bool:
    """``pid`` exists and has not exited: a killed process stays in /proc as a zombie (state Z)
    until its parent reaps it, and must count as gone before then (a dead rank, a dead spare)."""
    try:
        return _stat_fields(pid, proc)[:1] not in ([b"Z"], [b"X"])
    except OSError:  # ProcessLookupError included
        return False


def proc_uid(pid: int, proc: Path = PROC) -> int:
    try:
        return os.stat(proc / str(pid)).st_uid
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None


def proc_gid(pid: int, proc: Path = PROC) -> int:
    """The real gid of ``pid`` (``/proc/<pid>/status``); raises ProcessLookupError when it is gone."""
    try:
        raw = (proc / str(pid) / "status").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None
    for line in raw.splitlines():
        if line.startswith(b"Gid:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no Gid line")


def proc_exe(pid: int, proc: Path = PROC) -> str:
    try:
        return os.readlink(proc / str(pid) / "exe")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except PermissionError:
        return ""


def pid_namespace(pid: int | str = "self", proc: Path = PROC) -> int:
    """The inode of ``pid``'s pid namespace (0 when it cannot be read)."""
    try:
        return os.stat(proc / str(pid) / "ns" / "pid").st_ino
    except OSError:
        return 0


def ns_pids(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` in each pid namespace it belongs to, outermost first (``NSpid``); [] when unknown."""
    try:
        with open(proc / str(pid) / "status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def in_namespace(pid: int, nspid: int, pidns: int, proc: Path = PROC) -> bool:
    """Whether ``pid`` (as this process sees it) is the process ``nspid`` of pid namespace ``pidns``."""
    return pid_namespace(pid, proc) == pidns and (ns_pids(pid, proc) or [0])[-1] == nspid


def pids_in_namespace(pidns: int, proc: Path = PROC) -> dict[int, int]:
    """Every process of pid namespace ``pidns``: {its pid there: its pid here}. One scan of ``/proc``
    (about 0.1 ms a process: bench/pod_agent_lookup.py)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if name.isdigit() and pid_namespace(name, proc) == pidns:
            inner = ns_pids(int(name), proc)
            if inner:
                out[inner[-1]] = int(name)
    return out


def host_pid(nspid: int, pidns: int, proc: Path = PROC, *, hint: int | None = None) -> int | None:
    """The pid, as this process sees it, of the process whose pid is ``nspid`` inside the pid
    namespace ``pidns`` (an inode, :func:`pid_namespace`); None when no process is. ``hint``, a
    pid found before, is checked first (one process: no scan)."""
    if hint is not None and in_namespace(hint, nspid, pidns, proc):
        return hint
    found = pids_in_namespace(pidns, proc).get(nspid)
    return found if found is not None and in_namespace(found, nspid, pidns, proc) else None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def descends_from(pid: int, ancestor: int, ancestor_start: int, *, proc: Path = PROC, limit: int = 64) -> bool:
    """True when ``pid`` is ``ancestor`` (with that start time) or one of its descendants."""
    current = pid
    for _ in range(limit):
        try:
            ppid, start = proc_stat(current, proc)
        except (ProcessLookupError, ValueError, IndexError, OSError):
            return False
        if current == ancestor:
            return start == ancestor_start
        if ppid <= 1:
            return False
        current = ppid
    return False


@dataclass(frozen=True)
class AgentRecord:
    """What ``sentinel launch`` wrote about the agent it started."""

    pid: int
    start_time: int
    exe: str
    uid: int
    boot_id: str
    # the pid namespace ``pid`` is counted in (0: unknown, a record of an older version); the
    # daemon maps a pid of another namespace to the host's (module docstring)
    pidns: int = 0

    @classmethod
    def of(cls, pid: int, proc: Path = PROC) -> "AgentRecord":
        _, start = proc_stat(pid, proc)
        return cls(pid, start, proc_exe(pid, proc), proc_uid(pid, proc), boot_id(), pid_namespace(pid, proc))

    def encode(self) -> str:
        # line 1: the pid alone (what tools and humans expect of a pidfile); line 2: the identity
        return f"{self.pid}\n{json.dumps(asdict(self), separators=(',', ':'))}\n"


def write_agent_record(pidfile: Path, record: AgentRecord) -> None:
    """Atomically (never through a planted symlink) record the agent; mode 0644."""
    write_atomic(pidfile, record.encode(), mode=0o644)


def read_agent_record(pidfile: Path, *, owners: frozenset[int] = frozenset({0}), proc: Path = PROC,
                      mapped: dict | None = None) -> AgentRecord:
    """The recorded agent, verified live: raises FileNotFoundError when there is no pidfile and
    NotTrusted when it must not be acted on (symlink, wrong owner, bad content, pid <= 1, gone,
    reused pid, other executable, other boot). A record of another pid namespace comes back with
    the host pid (as this process sees it), found by :func:`host_pid`; ``mapped`` (a dict the
    caller keeps) remembers the last mapping so the next read needs no scan of ``/proc``."""
    try:
        raw = read_trusted(pidfile, owners=owners, max_bytes=4096)
    except UnsafePath as exc:
        raise NotTrusted(str(exc)) from None
    lines = raw.decode("utf-8", "replace").splitlines()
    try:
        data = json.loads(lines[1])
        rec = AgentRecord(**{k: data[k] for k in ("pid", "start_time", "exe", "uid", "boot_id")},
                          pidns=data.get("pidns", 0))
        if not all(isinstance(getattr(rec, k), int) and not isinstance(getattr(rec, k), bool)
                   for k in ("pid", "start_time", "uid", "pidns")):
            raise TypeError("pid, start_time, uid and pidns must be integers")
        if lines[0].strip() != str(rec.pid):
            raise ValueError("the pid line and the record disagree")
    except (IndexError, ValueError, TypeError, KeyError) as exc:
        raise NotTrusted(f"{pidfile} is not a record written by `sentinel launch` ({exc})") from None
    if rec.boot_id and rec.boot_id != boot_id():
        raise NotTrusted(f"{pidfile} was written before the last reboot")
    if rec.pidns and rec.pidns != pid_namespace("self", proc) and rec.pid > 0:
        # written in a pod (its own pid namespace): find the host process it names, then check it
        key = (rec.pidns, rec.pid, rec.start_time)
        hint, failed_at = (mapped or {}).get(key, (None, None))
        if failed_at is not None and time.monotonic() - failed_at < REMAP_SECONDS:
            found = None  # not found a moment ago: no scan of /proc at every read of a dead pod's record
        else:
            found = host_pid(rec.pid, rec.pidns, proc, hint=hint)
        if mapped is not None:
            mapped.clear()
            mapped[key] = (found, None if found is not None else (failed_at or time.monotonic()))
        if found is None:
            raise NotTrusted(f"agent pid {rec.pid} of pid namespace {rec.pidns} from {pidfile} has exited or is not "
                             f"visible here (the daemon needs the host's pid namespace: hostPID: true)")
        rec = dataclasses.replace(rec, pid=found)
    if rec.pid <= 1:
        raise NotTrusted(f"{pidfile} names pid {rec.pid}; only a pid > 1 can be an agent")
    try:
        _, start = proc_stat(rec.pid, proc)
        exe = proc_exe(rec.pid, proc)
        uid = proc_uid(rec.pid, proc)
    except (ProcessLookupError, OSError, ValueError, IndexError):
        raise NotTrusted(f"agent pid {rec.pid} from {pidfile} has exited") from None
    if start != rec.start_time:
        raise NotTrusted(f"pid {rec.pid} from {pidfile} is another process now (start time differs)")
    if rec.exe and exe and exe != rec.exe:
        raise NotTrusted(f"pid {rec.pid} from {pidfile} runs {exe}, not the recorded {rec.exe}")
    if uid != rec.uid:
        raise NotTrusted(f"pid {rec.pid} from {pidfile} runs as uid {uid}, not the recorded {rec.uid}")
    return rec


SLURM_STEPD = "slurmstepd"  # Debian installs it as slurmstepd-wlm (an alternatives link)


def job_origin(pid: int, kinds: tuple[str, ...], *, proc: Path = PROC, limit: int = 64) -> str:
    """Which kind of scheduler job process ``pid`` is (the first of ``kinds`` that holds), for a
    launcher that asked the daemon to record it; raises NotTrusted saying why none holds.

    Only facts the process's user cannot forge count:

    * ``slurm``: an ancestor is ``slurmstepd`` running as root (``/proc/<pid>/exe`` of a root
      process; an ordinary user can neither start a root process nor rename its executable). Only
      Slurm puts a process under a step daemon, and only into a job of that process's own user.
    * ``kubernetes``: the process is in a pod's cgroup (``kubepods`` in ``/proc/<pid>/cgroup``),
      where only the container runtime (root) places processes.
    """
    reasons = []
    for kind in kinds:
        if kind == "slurm":
            current = pid
            for _ in range(limit):
                try:
                    ppid, _ = proc_stat(current, proc)
                except (ProcessLookupError, ValueError, IndexError, OSError):
                    break
                if ppid <= 1:
                    break
                current = ppid
                try:
                    exe = os.path.basename(proc_exe(current, proc))
                    if proc_uid(current, proc) == 0 and (exe == SLURM_STEPD or exe.startswith(SLURM_STEPD + "-")):
                        return kind
                except (ProcessLookupError, OSError):
                    break
            reasons.append("not a task of a Slurm job step (no root slurmstepd above it)")
        elif kind == "kubernetes":
            try:
                cgroup = (proc / str(pid) / "cgroup").read_text()
            except OSError:
                cgroup = ""
            if "kubepods" in cgroup:
                return kind
            reasons.append("not in a Kubernetes pod's cgroup (kubepods)")
    if not reasons:
        raise NotTrusted("the daemon records no launcher but root's (actions.agent_registration = [])")
    raise NotTrusted("; ".join(reasons))


def signal_agent(rec: AgentRecord, sig: int, *, proc: Path = PROC) -> None:
    """Signal the recorded agent through a pidfd, re-checking its identity after the pidfd is
    open (so the signal cannot reach a process that reused the pid). Raises ProcessLookupError
    when it is gone, NotTrusted when the pid is another process now."""
    if rec.pid <= 1:
        raise NotTrusted(f"refusing to signal pid {rec.pid}")
    try:
        fd = os.pidfd_open(rec.pid)
    except ProcessLookupError:
        raise
    except OSError:
        fd = -1  # no pidfd support: the start-time check just below still guards the signal
    try:
        try:
            _, start = proc_stat(rec.pid, proc)
        except (ValueError, IndexError, OSError):
            raise ProcessLookupError(rec.pid) from None
        if start != rec.start_time:
            raise NotTrusted(f"pid {rec.pid} is another process now (start time differs)")
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(rec.pid, sig)
    finally:
        if fd >= 0:
            os.close(fd)


def is_socket_owned_by_process(path: Path, pid: int, proc: Path = PROC) -> tuple[bool, str]:
    """A rank socket counts only if it is a socket (not a symlink) owned by the uid that owns
    ``/proc/<pid>``. Returns (ok, reason)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False, "gone"
    if not stat.S_ISSOCK(st.st_mode):
        return False, "not_socket"
    try:
        uid = proc_uid(pid, proc)
    except ProcessLookupError:
        return False, "no_process"
    if st.st_uid != uid:
        return False, "owner_mismatch"
    return True, ""
