"""`sentinel launch --user`: the job runs unprivileged while the pidfile the daemon trusts stays root's."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

from conftest import REPO, wait_for
from sentinel.procs import read_agent_record


# `python3 -I -m sentinel launch`, as the agent unit runs it, with this checkout (root's) as the
# installed package: -I ignores PYTHONPATH, so the checkout goes on sys.path explicitly.
ISOLATED = [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from sentinel.cli import main; "
            "sys.exit(main(sys.argv[1:]))", str(REPO)]


def launch(*args, env=None, **kw):
    return subprocess.Popen([*ISOLATED, "launch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kw)


def test_the_agent_runs_as_the_user_and_the_root_owned_pidfile_names_it(attacker, shared_tmp):
    pidfile, state = shared_tmp / "run" / "agent.pid", shared_tmp / "state"
    state.mkdir()
    agent = ("import os, sys, time; print(os.getuid(), os.getgid(), sorted(os.getgroups()), os.environ['USER'], "
             "flush=True); time.sleep(60)")
    proc = launch("--user", attacker.name, "--pidfile", str(pidfile), "--state-dir", str(state), "--",
                  "/usr/bin/python3", "-c", agent)
    try:
        wait_for(pidfile.exists, timeout=20, what="the pidfile")
        uid, gid, groups, user = proc.stdout.readline().split(maxsplit=3)
        assert (int(uid), int(gid), user.strip()) == (attacker.uid, attacker.gid, attacker.name)
        assert groups == f"[{attacker.gid}]"  # the user's groups, not root's
        assert os.stat(pidfile).st_uid == 0
        record = read_agent_record(pidfile)  # what the daemon does: trusted, and it names the job's user
        assert record.uid == attacker.uid and record.pid != proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)  # forwarded to the agent
        proc.wait(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not pidfile.exists()


def test_the_same_environment_variable_the_agent_unit_sets(attacker, shared_tmp):
    state = shared_tmp / "state"
    state.mkdir()
    proc = subprocess.run([*ISOLATED, "launch", "--pidfile", str(shared_tmp / "a.pid"),
                           "--state-dir", str(state), "--", "/usr/bin/id", "-u"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "SENTINEL_AGENT_USER": attacker.name})
    assert proc.returncode == 0 and proc.stdout.strip() == str(attacker.uid), proc.stderr


def test_unknown_user_or_unprivileged_launcher_is_refused_before_anything_runs(attacker, shared_tmp):
    state = shared_tmp / "state"
    state.mkdir()
    marker = shared_tmp / "ran"
    r = subprocess.run([sys.executable, "-m", "sentinel", "launch", "--user", "no-such-user-sntl", "--pidfile",
                        str(shared_tmp / "a.pid"), "--state-dir", str(state), "--", "touch", str(marker)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "no such user" in r.stderr and not marker.exists()
    r = attacker.run(["/usr/bin/python3", "-m", "sentinel", "launch", "--user", "root", "--pidfile",
                      str(shared_tmp / "b.pid"), "--state-dir", str(state), "--", "touch", str(marker)],
                     env={"PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "needs the launcher to run as root" in r.stderr and not marker.exists()


def test_the_job_cannot_type_into_roots_terminal(attacker, shared_tmp):
    """Run from a root shell, the launcher's terminal is root's: a job that shared it as its
    controlling terminal could push "commands" into root's shell with TIOCSTI (allowed while
    dev.tty.legacy_tiocsti = 1). The agent gets a session of its own, as `su -c` gives it."""
    import fcntl
    import pty
    import select
    import termios
    import time

    state = shared_tmp / "state"
    state.mkdir()
    agent = ("import fcntl, os, termios\n"
             "try:\n"
             "    [fcntl.ioctl(0, termios.TIOCSTI, bytes([c])) for c in b'echo PWNED\\n']\n"
             "    typed = 'injected'\n"
             "except OSError as e:\n"
             "    typed = f'refused-{e.errno}'\n"
             "try:\n"
             "    os.close(os.open('/dev/tty', os.O_RDWR))\n"
             "    tty = 'root-tty'\n"
             "except OSError as e:\n"
             "    tty = f'no-tty-{e.errno}'\n"
             "print('RESULT', typed, tty, 'END', flush=True)\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([*ISOLATED, "launch", "--user", attacker.name, "--pidfile",
                             str(shared_tmp / "run" / "agent.pid"), "--state-dir", str(state), "--",
                             "/usr/bin/python3", "-c", agent],
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # root's terminal
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    os.close(slave)
    seen = b""
    try:
        end = time.monotonic() + 30
        while b"END" not in seen and time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # EIO: every holder of the slave closed it
                    break
        assert proc.wait(timeout=30) == 0, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(master)
    result = seen.decode(errors="replace").split("RESULT", 1)[-1].split()
    assert result[:2] == [f"refused-{errno.EPERM}", f"no-tty-{errno.ENXIO}"], seen
    assert b"PWNED" not in seen  # nothing reached the terminal's input queue


SITECUSTOMIZE = """
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"imported-by-uid-{os.getuid()}"), "w").close()
"""


def test_a_pythonpath_the_job_controls_is_never_imported_as_root(attacker, shared_tmp):
    """The env file gives the job a PYTHONPATH the job's user can write. The launcher (root) runs
    isolated, so only the agent (the user) imports from it; a launcher that is not isolated is
    refused before it starts anything."""
    evil = shared_tmp / "pythonpath"
    evil.mkdir()
    os.chown(evil, attacker.uid, attacker.gid)
    r = attacker.run(["sh", "-c", f"cat > {evil}/sitecustomize.py"], input=SITECUSTOMIZE)
    assert r.returncode == 0, r.stderr
    state = shared_tmp / "state"
    state.mkdir()
    proc = launch("--user", attacker.name, "--pidfile", str(shared_tmp / "a.pid"), "--state-dir", str(state), "--",
                  "/usr/bin/python3", "-c", "print('agent ran')", env={"PYTHONPATH": str(evil)})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "agent ran", err
    assert (evil / f"imported-by-uid-{attacker.uid}").exists()  # the job got its PYTHONPATH
    assert not (evil / "imported-by-uid-0").exists()  # root never imported from it
    # the console script's way (not isolated): refused, nothing run
    marker = shared_tmp / "ran"
    r = subprocess.run([sys.executable, "-m", "sentinel", "launch", "--user", attacker.name, "--pidfile",
                        str(shared_tmp / "b.pid"), "--state-dir", str(state), "--", "touch", str(marker)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "python3 -I -m sentinel launch" in r.stderr and not marker.exists()
