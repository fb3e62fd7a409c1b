"""``sentinel launch``: run the node's torchrun agent under an identity record the daemon trusts.

The launcher forks the agent, waits until the ``exec`` succeeded (a close-on-exec pipe), then
records the agent's pid, start time, executable, uid and boot id in the pidfile
(:func:`sentinel.procs.write_agent_record`: atomic, never through a symlink). It stays as the
agent's parent: it forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 to the agent (``systemctl stop``
signals the unit's main process), removes the pidfile when the agent exits, and exits with the
agent's status. Training ranks are the agent's descendants — that is how the daemon tells a
rank of this job from any other local process (:mod:`sentinel.channel`).

It refuses to start on a cordoned node (exit 3). The agent gets ``SENTINEL_STATE_DIR`` (so an
agent that understands it, ``python -m trainer.elastic``, never re-joins the rendezvous while
its node is being drained) and, with ``--warm``, ``SENTINEL_WARM=1``: the agent starts completely
but waits outside the rendezvous until ``sentinel admit`` sends it SIGUSR1 (a warm spare).

The launcher runs as root and, with ``user`` (``--user``, or ``SENTINEL_AGENT_USER`` from the
agent unit's environment file), runs the agent — and so the whole job — as that user: the child
takes a session of its own (no controlling terminal shared with root: no TIOCSTI into root's
shell), the user's groups, gid and uid before ``exec``, and the agent never starts if any of that
fails. As root with ``--user``, the launcher itself must run isolated (``python3 -I -m sentinel
launch``, as the agent unit does; refused otherwise, exit 2): the env file's ``PYTHONPATH`` is the
job's and must reach only the agent, never root's imports. The job still writes to the launcher's stdout and stderr: run it from a unit or ``srun``,
not from a root terminal left open for other work while the job (or a process it left behind)
runs. The launcher itself stays root because the daemon trusts only a root-owned pidfile (a
pidfile the job's user could write would let that user point root's SIGTERM at any process of
theirs, or claim another job's ranks) and because the cordon marker is root's.

Not root (an ordinary user's ``srun``, a non-root pod), the launcher cannot write that pidfile:
it asks the daemon over ``register.sock`` to record it instead (:func:`register_with_daemon`). The
daemon takes the launcher's pid from the kernel, checks that it is a task of a Slurm job step
or a pod's process (``actions.agent_registration``) and writes the record itself; the launcher
forwards the drain's SIGTERM to the agent as it does for root. docs/schedulers.md says why.
"""

from __future__ import annotations

import errno
import os
import pwd
import signal
import sys
from pathlib import Path

from sentinel.procs import AgentRecord, write_agent_record

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _fail(message: str, code: int) -> int:
    print(f"sentinel: {message}", file=sys.stderr)
    return code


def _refusal(command: list[str], pidfile: Path, state_dir: Path) -> int | None:
    """The exit code (after saying why) when the agent must not start: the node is cordoned (or
    its marker cannot be read), no command, no pidfile directory. None: go ahead."""
    from sentinel.migration import read_cordon

    if os.geteuid() != 0 and not os.access(state_dir, os.X_OK):
        # an ordinary user cannot look into the daemon's 0750 state directory: the running
        # daemon's status (root's, world-readable) says whether it cordoned this node
        marker, problem = _cordon_from_status(pidfile), ""
    else:
        marker, problem = read_cordon(state_dir / "cordon.json")
    if marker is not None:
        return _fail(f"node is cordoned ({state_dir / 'cordon.json'}: {marker.get('reason', '')}); "
                     f"clear it with `sentinel uncordon --state-dir {state_dir}`", 3)
    if problem:  # fail safe: a marker nobody can read still keeps the agent off this node
        return _fail(f"node is cordoned ({problem}); inspect it, then `sentinel uncordon --state-dir {state_dir}`", 3)
    if not command:
        return _fail("launch needs a command after --, e.g. sentinel launch -- torchrun ...", 2)
    try:
        pidfile.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"cannot create {pidfile.parent}: {exc.strerror}", 2)
    return None


def _wait(pid: int, pidfile: Path, record: AgentRecord | None) -> int:
    """Wait for the agent; remove its pidfile if still ours; its exit status as a shell reports it."""
    status = 0
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    if record is not None:  # remove the pidfile if it is still ours (a newer launch may own it)
        try:
            if pidfile.read_text().splitlines()[1:2] == record.encode().splitlines()[1:2]:
                pidfile.unlink()
        except (OSError, IndexError):
            pass
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def launch(command: list[str], pidfile: Path, state_dir: Path, user: str = "", *, warm: bool = False) -> int:
    account = None
    if user:
        try:
            account = pwd.getpwnam(user)
        except KeyError:
            return _fail(f"--user {user}: no such user", 2)
        if os.geteuid() != 0 and account.pw_uid != os.geteuid():
            return _fail(f"--user {user} needs the launcher to run as root", 2)
        if os.geteuid() == 0 and account.pw_uid != 0 and not sys.flags.isolated:
            # A Python that reads PYTHONPATH, PYTHONHOME, the user site or the current directory
            # imports, as root, whatever the job's user put there (the env file is the job's).
            return _fail(f"--user {user}: the launcher runs as root and must run isolated: "
                         f"`python3 -I -m sentinel launch ...` (the agent unit does; `sentinel install` writes it)", 2)

    refused = _refusal(command, pidfile, state_dir)
    if refused is not None:
        return refused

    env = {**os.environ, "SENTINEL_STATE_DIR": str(state_dir)}
    if warm:
        env["SENTINEL_WARM"] = "1"
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # the agent
        os.close(r)
        try:
            if account is not None and account.pw_uid != os.geteuid():
                # A session of its own: the job must not share root's controlling terminal, or it
                # could push keystrokes into root's shell with TIOCSTI (as `su -c` does, setsid).
                os.setsid()
                os.initgroups(account.pw_name, account.pw_gid)
                os.setgid(account.pw_gid)
                os.setuid(account.pw_uid)
                env.update(USER=account.pw_name, LOGNAME=account.pw_name, HOME=account.pw_dir)
            os.execvpe(command[0], command, env)
        except OSError as exc:
            os.write(w, str(exc.errno or errno.ENOENT).encode())
        os._exit(127)
    os.close(w)
    received = os.read(r, 64)
    os.close(r)
    if received:
        os.waitpid(pid, 0)
        return _fail(f"cannot run {command[0]}: {os.strerror(int(received))}", 127)

    def forward(signum, _frame):  # only os.kill: nothing here takes a lock
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    record = None
    try:
        record = AgentRecord.of(pid)
        write_agent_record(pidfile, record)
    except PermissionError:  # not root (an ordinary user's Slurm job, a non-root pod): ask the daemon
        record = None
        register_with_daemon(pidfile)
    except (OSError, ProcessLookupError) as exc:
        record = None
        print(f"sentinel: warning: cannot record the agent in {pidfile}: {exc}; the daemon will not "
              f"recognise this job's ranks", file=sys.stderr)
    return _wait(pid, pidfile, record)


def _cordon_from_status(pidfile: Path) -> dict | None:
    """The running daemon's cordon (from ``status.json`` in its runtime directory), or None."""
    import json

    from sentinel.fsutil import UnsafePath, read_trusted

    directory = Path(os.environ.get("SENTINEL_RUNTIME_DIR") or pidfile.parent)
    try:
        status = json.loads(read_trusted(directory / "status.json", owners=frozenset({0}), max_bytes=1 << 22))
    except (OSError, UnsafePath, ValueError):
        return None
    if isinstance(status, dict) and status.get("cordoned"):
        migration = status.get("migration") or {}
        return {"reason": f"{migration.get('rule', '?')}: {migration.get('reason', '')} (the daemon's status)"}
    return None


def register_with_daemon(pidfile: Path, *, wait_seconds: float = 10.0) -> bool:
    """Ask the node's daemon to record this launcher (the agent's parent, which forwards signals to
    it) as the agent, then wait (bounded) for the pidfile to name it. The daemon takes the pid from
    the kernel and records only a process of a scheduler's job (:mod:`sentinel.channel`). Says on
    stderr what happened; returns whether the daemon recorded it."""
    import json
    import time

    from sentinel import channel, procs

    directory = Path(os.environ.get("SENTINEL_RUNTIME_DIR") or pidfile.parent)
    try:
        channel.register(directory)
    except OSError as exc:
        print(f"sentinel: warning: cannot record the agent in {pidfile} (not root) nor ask the daemon to "
              f"({directory / 'register.sock'}: {exc.strerror or exc}); the daemon will not recognise this job's "
              f"ranks", file=sys.stderr)
        return False
    me, uid, ns = os.getpid(), os.getuid(), procs.pid_namespace()
    _, start = procs.proc_stat(me)
    end = time.monotonic() + wait_seconds
    while time.monotonic() < end:
        try:
            data = json.loads(pidfile.read_text().splitlines()[1])
            if (data.get("start_time") == start and data.get("uid") == uid
                    and (data.get("pid") == me or data.get("pidns") != ns)):
                print(f"sentinel: the daemon recorded this job's agent (launcher pid {data['pid']} on the host, "
                      f"{directory / 'register.sock'})", file=sys.stderr)
                return True
        except (OSError, IndexError, ValueError, AttributeError):
            pass
        time.sleep(0.1)
    print(f"sentinel: warning: the daemon did not record this agent within {wait_seconds:g} s (its log says why: "
          f"\"agent registration ... refused\"); the daemon will not recognise this job's ranks", file=sys.stderr)
    return False


def admit(pidfile: Path) -> int:
    """``sentinel admit``: tell the warm spare agent recorded in ``pidfile`` to join the
    rendezvous (SIGUSR1 through a pidfd, only to the process the record still names)."""
    from sentinel import procs

    try:
        agent = procs.read_agent_record(pidfile, owners=frozenset({0, os.geteuid()}))
        procs.signal_agent(agent, signal.SIGUSR1)
    except FileNotFoundError:
        return _fail(f"no agent to admit: {pidfile} does not exist", 1)
    except ProcessLookupError:
        return _fail(f"no agent to admit: the agent recorded in {pidfile} has exited", 1)
    except (procs.NotTrusted, OSError) as exc:
        return _fail(f"not admitting the agent recorded in {pidfile}: {exc}", 1)
    print(f"admitted the agent pid {agent.pid}")
    return 0
