"""The workers' forkserver of ``python -m trainer.elastic``, forked from the agent itself.

multiprocessing starts a forkserver as a new interpreter, which then imports its preload
modules: torch, :mod:`trainer.warmup` and the training module, 4.6 CPU-s on this project's 2-core
VM, while the agent has already imported torch for its own use (2.5 CPU-s). Here the agent
imports the preload modules and then *forks* the forkserver, which runs multiprocessing's own
``forkserver.main`` with everything already imported: one torch import per node instead of two,
and a warm spare is ready that much sooner. The workers are forks of it exactly as before.

A fork is safe only while the agent has nothing a child must not inherit, so it is made at one
point of the agent's start, before the rendezvous handler connects to its store and before any
Python thread exists; the child then puts back what the agent had changed (signal handlers and
the wakeup fd, logging) and closes every file descriptor but the two multiprocessing passes to a
spawned forkserver. When Python's multiprocessing is not the one this was written for (Python
3.9-3.13: ``forkserver.main(listener_fd, alive_r, preload, main_path, sys_path)`` and no
authentication key) or a Python thread is running, the agent starts multiprocessing's own
forkserver, as before, and says why.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

log = logging.getLogger("sentinel.elastic")

_MAIN_PARAMS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def why_not_fork(fs: Any) -> str:
    """'' when multiprocessing's forkserver ``fs`` can be forked from this process; else why not."""
    from multiprocessing import forkserver

    if list(inspect.signature(forkserver.main).parameters) != _MAIN_PARAMS:
        return f"multiprocessing.forkserver.main{inspect.signature(forkserver.main)} is not the known one"
    if not all(hasattr(fs, a) for a in ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")):
        return "multiprocessing's ForkServer lacks the known attributes"
    if hasattr(fs, "_forkserver_authkey"):
        return "this Python's forkserver authenticates its clients"
    if fs._forkserver_pid is not None:
        return "a forkserver is already running"
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        return f"Python threads are running ({', '.join(extra)})"
    return ""


def start(preload: list[str]) -> str:
    """Start this process's forkserver with ``preload`` imported and wait until it serves; how it
    was started: "forked from the agent" or "a new interpreter (<why>)"."""
    import multiprocessing
    from multiprocessing import connection, forkserver, resource_tracker, util

    multiprocessing.set_forkserver_preload(preload)
    fs = forkserver._forkserver
    why = why_not_fork(fs)
    if not why:
        for name in preload:
            importlib.import_module(name)
        why = why_not_fork(fs)  # an import may have started a thread
    if why:
        _first_fork()
        return f"a new interpreter ({why})"
    with fs._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _serve(listener.fileno(), alive_r, preload)  # never returns
            os.close(alive_r)
        fs._forkserver_address = address
        fs._forkserver_alive_fd = alive_w
        fs._forkserver_pid = pid
    _first_fork()
    return "forked from the agent"


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """In the forked child: become what a spawned forkserver is, then serve until the agent is gone."""
    code = 0
    try:
        from multiprocessing import forkserver

        # forked while the agent held it: a worker starting processes of its own would wait forever
        forkserver._forkserver._lock = threading.Lock()
        signal.set_wakeup_fd(-1)
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        root.setLevel(logging.WARNING)  # as in a new interpreter: a worker's basicConfig() takes effect
        keep = sorted({listener_fd, alive_r})
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, os.sysconf("SC_OPEN_MAX"))
        forkserver.main(listener_fd, alive_r, preload)
    except SystemExit:  # main's way out: every client (the agent) is gone
        pass
    except BaseException as exc:  # noqa: BLE001 - reported, then the process ends
        print(f"trainer.elastic: forkserver failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _noop() -> None:
    pass


def _first_fork() -> None:
    """Fork one process from the forkserver and wait for it: the forkserver is up and has imported
    its preload modules when it returns."""
    import multiprocessing

    p = multiprocessing.get_context("forkserver").Process(target=_noop)
    p.start()
    p.join()
