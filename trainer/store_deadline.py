"""A deadline the agent keeps itself when its single rendezvous store is lost (issue #41,
``--fault store-host``): one clear line, then the agent and its workers gone, within a bound —
whatever call the agent is blocked in.

A store call on a c10d ``TCPStore`` has a socket timeout (``--rdzv-conf read_timeout``), and the
agent says the store is lost when a call fails (:func:`trainer.elastic._run_agent`). That is not a
bound on the agent: after the failure torch's agent still stops its workers (a worker that holds
on SIGTERM for a migrate snapshot takes up to its hold), and a call that does not honour its
timeout blocks for as long as it likes (one run left two agents blocked 8 min with
``read_timeout=10`` at load 15-170). Here:

* every store call of the rendezvous handler is *tracked* (:meth:`StoreDeadline.track`);
* a daemon thread probes the store's endpoint (a TCP connect, ``probe_seconds``) while a call is
  in flight; a call that has been in flight for ``read_timeout + probe_seconds`` while every
  probe since it began failed means the store is lost;
* the store is also lost when a tracked call raises a connection error;
* on loss: the one line (``LINE``) on stderr at once, the daemon told (``on_lost``), and a hard
  deadline armed: if the agent has not exited ``exit_seconds`` later, its descendants (the
  forkserver and the workers) get SIGKILL and the agent ``os._exit(1)``.

The bound from the store's loss to the agent gone, when the agent is calling the store:
``read_timeout + probe_seconds + exit_seconds`` (tests/test_store_deadline.py). A job that does
not call its store (no membership change needed) runs on: a lost store is only fatal when needed.
A replicated store (``sentinel-etcd``) fails over instead: it is not watched here.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

LINE = "trainer.elastic: the rendezvous store"  # drills look for it (sentinel_tools.drill_netns.STORE_LOSS_LINE)
EXIT_SECONDS = 5.0
PROBE_SECONDS = 2.0
TRACKED = ("next_rendezvous", "num_nodes_waiting", "shutdown", "set_closed", "is_closed", "sync")
# a lost store, as torch raises it (c10d: RendezvousConnectionError from the DistNetworkError; a
# TCPStore call: DistNetworkError). Not DistStoreError: a wait that timed out is not a lost store
CONNECTION_ERRORS = ("RendezvousConnectionError", "DistNetworkError")


def _is_lost(exc: BaseException | None) -> bool:
    return exc is not None and (type(exc).__name__ in CONNECTION_ERRORS or isinstance(exc, ConnectionError))


REPORT_LINGER_SECONDS = 2.0  # an agent's last report: the daemon (polling each second) reads it while it lives


def tell_daemon(endpoint: str, why: str) -> None:
    """``sentinel status`` on this node says it too: a ``rendezvous`` report over the control
    channel (this agent is one of the job's processes, as its ranks are). The daemon verifies the
    sender when it reads the report, so the agent stays a moment (two of its polls) before it exits."""
    from sentinel.channel import RankEndpoint, Report

    channel = RankEndpoint.open()
    try:
        if channel.report(Report("rendezvous", 0, -1, {"store": endpoint, "reachable": False, "error": why[:300]})):
            time.sleep(REPORT_LINGER_SECONDS)
    finally:
        channel.close()


def line(endpoint: str, why: str) -> str:
    return f"{LINE} {endpoint or '(endpoint unknown)'} cannot be reached ({why}): this job cannot continue without it"


def probe(endpoint: str, timeout: float) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout``."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def below(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is now a process below ``ancestor`` (its parent chain, read from /proc)."""
    seen = 0
    while pid > 1 and seen < 4096:
        parent = _parent(pid)
        if parent is None:
            return False
        if parent == ancestor:
            return True
        pid, seen = parent, seen + 1
    return False


def kill_descendants(pid: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process below ``pid``; how many. A pid listed by :func:`descendants`
    may have exited and been reused by an unrelated process (any user's: the agent may run as
    root when launched without ``--user``) before the signal: each is opened as a pidfd, checked
    to be below ``pid`` *after* it was opened, and signalled through the pidfd — the signal goes
    to the process that was checked, or to none."""
    n = 0
    for child in descendants(pid):
        try:
            fd = os.pidfd_open(child)
        except OSError:
            continue  # gone already
        try:
            if below(child, pid):
                signal.pidfd_send_signal(fd, sig)
                n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


class StoreDeadline:
    def __init__(self, endpoint: str, read_timeout: float, *, on_lost: Callable[[str], None] | None = None,
                 probe_seconds: float = PROBE_SECONDS, exit_seconds: float = EXIT_SECONDS,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.endpoint = endpoint
        self.limit = read_timeout + probe_seconds
        self.probe_seconds = probe_seconds
        self.exit_seconds = exit_seconds
        self.on_lost = on_lost
        self._exit = exit
        self._lock = threading.Lock()
        self._calls: dict[int, float] = {}  # thread id -> when its tracked call began
        self._reached_at = time.monotonic()  # the last probe that reached the store
        self.lost_why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- tracking -----------------------------------------------------------------------------
    def track(self, handler: Any, names: tuple[str, ...] = TRACKED) -> None:
        """Wrap ``handler``'s store-calling methods (those it has) on the instance."""
        for name in names:
            method = getattr(handler, name, None)
            if callable(method):
                setattr(handler, name, self._tracked(method))

    def _tracked(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args, **kwargs):
            me = threading.get_ident()
            with self._lock:
                outer = me not in self._calls
                if outer:
                    self._calls[me] = time.monotonic()
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                if _is_lost(exc) or _is_lost(exc.__cause__):
                    cause = exc.__cause__ or exc
                    text = str(cause).splitlines()[0] if str(cause) else "no detail"
                    self.lost(f"{type(cause).__name__}: {text}")
                raise
            finally:
                if outer:
                    with self._lock:
                        self._calls.pop(me, None)
        return call

    # -- the watch ----------------------------------------------------------------------------
    def start(self) -> "StoreDeadline":
        self._thread = threading.Thread(target=self._watch, name="sentinel-store-deadline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.probe_seconds / 2):
            with self._lock:
                since = min(self._calls.values(), default=None)
            if since is None:
                continue
            if probe(self.endpoint, self.probe_seconds):
                self._reached_at = time.monotonic()
                continue
            now = time.monotonic()
            if now - max(since, self._reached_at) >= self.limit:
                self.lost(f"no answer from it for {now - max(since, self._reached_at):.0f} s while the agent waited on it")
                return

    def lost(self, why: str) -> None:
        """Say it once, tell the daemon, arm the hard deadline."""
        with self._lock:
            if self.lost_why:
                return
            self.lost_why = why
        print(line(self.endpoint, why), file=sys.stderr, flush=True)
        timer = threading.Timer(self.exit_seconds, self._hard_exit)
        timer.daemon = True
        timer.start()
        if self.on_lost is not None:
            try:
                self.on_lost(why)
            except Exception as exc:  # noqa: BLE001 - the line is said; the report is best effort
                print(f"trainer.elastic: could not tell the daemon: {exc}", file=sys.stderr, flush=True)

    def _hard_exit(self) -> None:
        print(f"trainer.elastic: still running {self.exit_seconds:.0f} s after the store was lost: "
              "stopping the workers and exiting", file=sys.stderr, flush=True)
        kill_descendants(os.getpid())
        sys.stderr.flush()
        self._exit(1)


def for_agent(config: Any, handler: Any) -> "StoreDeadline | None":
    """A single store (c10d, or the slot rendezvous on a TCPStore): the agent's own deadline once
    it is lost, started, tracking ``handler``'s store calls. None for a replicated store (it fails
    over). ``config``: torchrun's LaunchConfig."""
    if config.rdzv_backend not in ("c10d", "sentinel") or not config.rdzv_endpoint:
        return None
    endpoint = config.rdzv_endpoint
    deadline = StoreDeadline(endpoint, float(config.rdzv_configs.get("read_timeout", 60)),
                             on_lost=lambda why: tell_daemon(endpoint, why))
    deadline.track(handler)
    return deadline.start()
