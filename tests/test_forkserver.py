"""trainer.forkserver: the workers' forkserver forked from the agent (no torch needed: the
preload here is a standard-library module; test_elastic and the drills run it under torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, wait_for

AGENT = r"""
import json, logging, multiprocessing, os, signal, sys, threading, time
from trainer import forkserver

def report(q, fd):
    from multiprocessing import forkserver as mpf

    lock_free = mpf._forkserver._lock.acquire(timeout=5)  # a worker may start processes of its own
    if lock_free:
        mpf._forkserver._lock.release()
    links = [os.path.realpath(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")]
    open_fd = fd in links
    q.put({"pid": os.getpid(), "ppid": os.getppid(), "usr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
           "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "root_handlers": len(logging.getLogger().handlers),
           "secret_open": open_fd, "json": "json" in sys.modules, "lock_free": lock_free})


# everything a worker runs is defined before the fork, as in trainer.elastic (its __main__ is the
# agent's module, not re-imported); the guard is for the fallback, whose forkserver imports this file
if __name__ == "__main__":
    mode = sys.argv[1]
    signal.signal(signal.SIGUSR1, lambda *_: None)      # what trainer.elastic's _Signals does
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    logging.basicConfig(level=logging.INFO)             # the agent's log format
    secret = os.open(sys.argv[2], os.O_RDONLY)          # a descriptor the workers must not get
    if mode == "thread":
        threading.Thread(target=time.sleep, args=(30,), daemon=True, name="keep-alive").start()
    how = forkserver.start(["json"])

    ctx = multiprocessing.get_context("forkserver")
    q = ctx.Queue()
    p = ctx.Process(target=report, args=(q, os.path.realpath(sys.argv[2])))
    p.start()
    child = q.get(timeout=60)
    p.join(60)
    from multiprocessing import forkserver as mpf
    print(json.dumps({"how": how, "agent": os.getpid(), "server": mpf._forkserver._forkserver_pid, "child": child}), flush=True)
    if mode == "linger":
        time.sleep(60)
"""


def _agent(tmp_path, mode: str, **kw) -> subprocess.Popen:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    secret = tmp_path / "secret"
    secret.write_text("the agent's\n")
    return subprocess.Popen([sys.executable, str(script), mode, str(secret)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_workers_fork_from_a_forkserver_forked_from_the_agent_with_the_agent_s_state_put_back(tmp_path):
    p = _agent(tmp_path, "plain")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    r = json.loads(out.splitlines()[-1])
    assert r["how"] == "forked from the agent"
    child = r["child"]
    assert child["ppid"] == r["server"] and r["server"] != r["agent"]  # a fork of the forkserver
    assert child["json"]  # preloaded
    # what the agent had changed is put back, as in a new interpreter
    assert child["usr1"] and child["term"] and child["root_handlers"] == 0
    assert not child["secret_open"]
    assert child["lock_free"]  # multiprocessing's lock, held by the agent when it forked


def test_the_forked_forkserver_ends_with_its_agent(tmp_path):
    p = _agent(tmp_path, "linger")
    try:
        line = p.stdout.readline()
        r = json.loads(line)
        server = r["server"]
        os.kill(server, 0)
        p.kill()  # no clean-up: the alive pipe's last writer is gone
        p.wait(timeout=60)

        def gone() -> bool:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                return True
            # a zombie counts as gone: its parent (the killed agent) was reaped, so init reaps it
            try:
                with open(f"/proc/{server}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True
        wait_for(gone, 60, what="the forkserver to end with its agent")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=60)


def test_a_running_python_thread_makes_the_agent_start_a_new_interpreter_instead(tmp_path):
    p = _agent(tmp_path, "thread")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    r = json.loads(out.splitlines()[-1])
    assert r["how"] == "a new interpreter (Python threads are running (keep-alive))"
    assert r["child"]["ppid"] == r["server"] and r["child"]["json"]


def test_an_unknown_multiprocessing_is_not_forked(monkeypatch):
    from multiprocessing import forkserver as mpf

    from trainer import forkserver

    class Authenticating:
        _lock = _forkserver_address = _forkserver_alive_fd = _forkserver_pid = None
        _forkserver_authkey = b"k"

    assert forkserver.why_not_fork(Authenticating()) == "this Python's forkserver authenticates its clients"
    monkeypatch.setattr(mpf, "main", lambda listener_fd, alive_r, preload, authkey_r=None: None)
    assert "is not the known one" in forkserver.why_not_fork(mpf.ForkServer())
