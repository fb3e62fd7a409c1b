"""The workers' store of one generation (issue #42 point 4): torch's TCPStore cannot be
authenticated, so what is bounded is where it listens, for how long, and how long another local
user can stall the job through it. The attack runs for real, as ``nobody``, with plain sockets
(no torch, no knowledge of the job): it finds the store's port in /proc/net/tcp, as any local
user can, and (1) sends garbage on a few hundred held connections, then (2) takes every file
descriptor of the process that hosts the store. The workers are real gloo process groups.

The bound asserted is the job's own: a worker that cannot reach the store ends with an error
within its process-group timeout plus MARGIN_SECONDS (torch's connect back-off), never hangs; the
next generation's store, on a fresh port, serves the job (docs/security.md "The workers' store").
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ADDR = "127.38.42.7"  # the job's address here: a loopback address nothing else on this machine uses
PG_TIMEOUT = 5.0  # the workers' process-group timeout (trainer.train --pg-timeout)
MARGIN_SECONDS = 10.0  # torch's store client retries its connect with a back-off of up to a few s
HOST_FDS = 1024  # the store host's RLIMIT_NOFILE: the common default soft limit (raised, it costs the attacker more connections)
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

HOST = f"""
import gc, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({HOST_FDS}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from trainer.slot_rendezvous import SlotRendezvousHandler
generation = []
for line in sys.stdin:  # one line: the next generation (the rendezvous drops the previous store)
    generation.clear(); gc.collect()
    try:
        generation.append(SlotRendezvousHandler._tcp_server({ADDR!r}))
        print(generation[0].port, flush=True)
    except RuntimeError as exc:
        print("error", exc, flush=True)
"""

WORKER = f"""
import json, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank = int(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    t = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{ADDR}:{{int(line)}}", rank=rank, world_size=2,
                                timeout=timedelta(seconds={PG_TIMEOUT}))
        x = torch.ones(1); dist.all_reduce(x); dist.destroy_process_group()
        out = {{"ok": x.item() == 2}}
    except Exception as exc:
        out = {{"error": type(exc).__name__ + ": " + (str(exc).splitlines() or [""])[0][:200]}}
    out["seconds"] = time.monotonic() - t
    print(json.dumps(out), flush=True)
"""

# the attacker: another local user, plain sockets only
ATTACKER = f"""
import os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
want = "".join(f"{{int(b):02X}}" for b in reversed({ADDR!r}.split(".")))
def listening():
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        f = line.split(); a, p = f[1].split(":")
        if a == want and f[3] == "0A":
            return int(p, 16)
port = None
while port is None:
    port = listening(); time.sleep(0.05)
print("found", port, flush=True)
held = []
def connect(n, garbage):
    for _ in range(n):
        try:
            c = socket.create_connection(({ADDR!r}, port), timeout=2)
            if garbage:  # an unknown command byte, then a frame that claims 2**62 bytes
                c.sendall(os.urandom(64) + b"\\x00" + (2**62).to_bytes(8, "little") + b"key")
            held.append(c)
        except OSError:
            pass
for line in sys.stdin:
    what, n = line.split()
    connect(int(n), what == "garbage")
    print("holding", len(held), flush=True)
"""


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no answer within {timeout} s"
    line = proc.stdout.readline()
    assert line, f"process ended: {proc.poll()}"
    return line.strip()


def _ask(proc: subprocess.Popen, text: str, timeout: float) -> str:
    proc.stdin.write(text + "\n")
    proc.stdin.flush()
    return _line(proc, timeout)


def _generation(workers: list[subprocess.Popen], port: int) -> list[dict]:
    for w in workers:
        w.stdin.write(f"{port}\n")
        w.stdin.flush()
    return [json.loads(_line(w, PG_TIMEOUT + MARGIN_SECONDS + 30)) for w in workers]


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (IPv4 and IPv6 tables)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, p = f[1].split(":")
            if f[3] == "0A" and int(p, 16) == port:
                found.append(addr)
    return found


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv (util-linux)")
def test_another_user_cannot_stall_the_workers_store_past_the_process_group_timeout():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []

    def start(argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, **kw)
        procs.append(p)
        return p

    try:
        host = start([sys.executable, "-c", HOST], env=env)
        # as torch's agent starts them: every worker a client of the agent's store
        agent_store = {**env, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
        workers = [start([sys.executable, "-c", WORKER, str(r)], env=agent_store) for r in (0, 1)]
        first = int(_ask(host, "next", 60))
        assert _listeners(first) == [f"{int(ADDR.split('.')[3]):02X}{int(ADDR.split('.')[2]):02X}"
                                     f"{int(ADDR.split('.')[1]):02X}{int(ADDR.split('.')[0]):02X}"], \
            "the store listens on the job's address only"
        attacker = start(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                          SYSTEM_PYTHON, "-c", ATTACKER], env={"PATH": "/usr/bin:/bin"}, cwd="/")
        assert _line(attacker, 30) == f"found {first}"  # the port is no secret to a local user
        for w in workers:
            assert _line(w, 120) == "ready"

        # (1) garbage on held connections: the store drops those clients and serves the job
        assert int(_ask(attacker, "garbage 200", 60).split()[1]) >= 100
        garbage = _generation(workers, first)
        assert all(r.get("ok") for r in garbage), garbage

        # (2) every file descriptor of the store's host taken: the workers end with an error within
        # their process-group timeout + the margin (no hang), which their agent turns into a restart
        assert int(_ask(attacker, f"flood {HOST_FDS + 100}", 120).split()[1]) >= HOST_FDS - 50
        stalled = _generation(workers, first)
        print("stalled generation:", stalled)
        for r in stalled:
            assert "error" in r and r["seconds"] <= PG_TIMEOUT + MARGIN_SECONDS, r

        # the next generation: the previous store (and every connection to it) is gone; a fresh port serves the job
        second = _ask(host, "next", 60)
        assert second.isdigit() and int(second) != first, second
        assert _listeners(first) == []
        recovered = _generation(workers, int(second))
        assert all(r.get("ok") for r in recovered), recovered
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
