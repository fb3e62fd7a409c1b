"""The agent's own deadline on a lost single rendezvous store (trainer/store_deadline.py, issue #41
``--fault store-host``): one clear line, then the agent and its workers gone within
read_timeout + probe + exit seconds, whatever call the agent is blocked in; a slow call on a store
that answers is left alone. Each case is an agent-like process of its own (the hard exit kills the
process's descendants: never this test's), with a real child standing in for a worker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READ_TIMEOUT, PROBE, EXIT = 1.0, 0.5, 1.0
BOUND = READ_TIMEOUT + PROBE + EXIT + 5.0  # + 5 s: the process's start and the probe's own connect timeout

AGENT = """
import subprocess, sys, threading, time
from trainer.store_deadline import StoreDeadline
endpoint, mode = sys.argv[1], sys.argv[2]
class RendezvousConnectionError(Exception): pass
class Handler:
    def next_rendezvous(self):
        if mode == "raise":
            raise RendezvousConnectionError("The connection to the C10d store has failed.")
        time.sleep(float(sys.argv[3]))  # a call that ignores its own timeout
        return "done"
worker = subprocess.Popen(["sleep", "600"])
print(f"worker {worker.pid}", flush=True)
deadline = StoreDeadline(endpoint, %(read)r, probe_seconds=%(probe)r, exit_seconds=%(exit)r,
                         on_lost=lambda why: print("told the daemon:", why, flush=True))
h = Handler()
deadline.track(h)
deadline.start()
try:
    print("returned", h.next_rendezvous(), flush=True)
except RendezvousConnectionError:
    time.sleep(600)  # as an agent stuck stopping workers that hold on SIGTERM
worker.kill()
""" % {"read": READ_TIMEOUT, "probe": PROBE, "exit": EXIT}


def _agent(endpoint: str, mode: str, seconds: float = 600.0) -> tuple[subprocess.CompletedProcess, float, int]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-c", AGENT, endpoint, mode, str(seconds)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    worker = int(p.stdout.split("worker ", 1)[1].split()[0])
    return p, time.monotonic() - t, worker


def _gone(pid: int, within: float = 10.0) -> bool:
    """The process is gone (or a zombie) within ``within`` s: a SIGKILL is delivered, not instant."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed: the store's host is gone


def test_a_call_blocked_on_a_lost_store_ends_the_agent_and_its_workers_within_the_bound():
    p, seconds, worker = _agent(f"127.0.0.1:{_closed_port()}", "block")
    assert p.returncode == 1 and seconds <= BOUND, (p.returncode, seconds, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.startswith("trainer.elastic: the rendezvous store")]
    assert len(lines) == 1 and "this job cannot continue without it" in lines[0], p.stderr
    assert "told the daemon" in p.stdout and _gone(worker)


def test_a_lost_store_raised_by_a_call_is_said_at_once_and_the_exit_is_enforced():
    p, seconds, worker = _agent(f"127.0.0.1:{_closed_port()}", "raise")
    assert p.returncode == 1 and seconds <= BOUND, (p.returncode, seconds, p.stderr)
    assert "RendezvousConnectionError" in p.stderr and "stopping the workers and exiting" in p.stderr
    assert _gone(worker)


def test_a_slow_call_on_a_store_that_answers_is_left_alone():
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen(64)
        slow = READ_TIMEOUT + PROBE + 2.0  # longer than the limit: only the probe's answer keeps it going
        p, _, worker = _agent(f"127.0.0.1:{store.getsockname()[1]}", "block", slow)
    assert p.returncode == 0 and "returned done" in p.stdout, p.stderr
    assert "rendezvous store" not in p.stderr


def test_the_hard_exit_kills_no_process_that_took_a_listed_descendant_s_pid(monkeypatch):
    """The hard exit lists the agent's descendants from /proc, then signals them. A listed one may
    exit and its pid go to an unrelated process meanwhile — any user's, and the agent is root when
    launched without ``--user``. Here the list names a process of ``nobody`` (not below this one:
    its shell exited, it was reparented) as well as a real child: the child dies, ``nobody``'s
    process lives."""
    from trainer import store_deadline

    started = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups", "sh", "-c",
                              "sleep 120 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, timeout=30)
    other = int(started.stdout.strip())
    child = subprocess.Popen(["sleep", "120"])
    try:
        monkeypatch.setattr(store_deadline, "descendants", lambda pid: [other, child.pid])  # as a pid reuse leaves it
        exits: list[int] = []
        store_deadline.StoreDeadline("127.0.0.1:1", 1.0, exit=exits.append)._hard_exit()
        assert exits == [1] and child.wait(timeout=30) == -9
        assert not _gone(other, within=0.5), "a process that was not the agent's descendant was killed"
    finally:
        child.kill()
        child.wait(timeout=30)
        try:
            os.kill(other, 9)
        except ProcessLookupError:
            pass
