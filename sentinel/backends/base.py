"""The action backend interface: how a node is cordoned, uncordoned, asked about, drained of its
agent, and how a spare is started.

A backend is one module in ``sentinel/backends/`` that defines ``BACKEND`` (a :class:`Backend`
subclass); ``[actions] backend = "<name>"`` picks it (:data:`sentinel.backends.NAMES`). Every
backend keeps the local cordon marker (``<state_dir>/cordon.json``: ``sentinel launch`` refuses
to start an agent while it exists, and it is how ``sentinel uncordon`` knows the cordon is
Sentinel's) and adds its scheduler's own view of the node on top.

Contract (each method may block; the daemon calls them on a worker thread, never on its loop):

* ``check()`` — at start: raise :class:`UnknownNode` / :class:`PermissionDenied` with one clear
  sentence; :class:`Unreachable` means "could not tell" (the daemon starts and says so).
* ``cordon(reason)`` — keep new work off the node; idempotent. A cordon someone else set (an
  admin's drain) is left as it is and reported, never overwritten.
* ``uncordon()`` — remove exactly what Sentinel added (never an admin's drain, taint or cordon);
  returns one line saying what it did.
* ``is_cordoned()`` — a :class:`CordonState`: whether the scheduler keeps work off the node and
  whether that is Sentinel's doing.
* ``stop_agent()`` — stop this node's torchrun agent (SIGTERM through a pidfd by default).
* ``start_spare()`` — bring a cold spare's agent up; returns one line saying which.
* ``fleet(now)`` — for the circuit breaker: how many of the job's / partition's nodes there
  are and when Sentinel cordoned each of those it cordoned; ``None`` when the backend has no
  view of other nodes (file, command).
* ``topology()`` — the :class:`sentinel.topology.Topology` from ``[actions.topology] file`` and
  the scheduler's own (``scheduler_topology()``); raises :class:`sentinel.topology.TopologyError`
  on a file it cannot read or a contradiction. ``start_spare()`` sets ``spare_choice`` (a
  :class:`sentinel.topology.SpareChoice`) when it chose a spare by distance.

Errors: :class:`Unreachable` (timeout, connection refused, 5xx: retried with backoff),
:class:`PermissionDenied` and :class:`UnknownNode` (not retried: the message names the missing
RBAC verb or Slurm privilege, or the node), :class:`BackendError` (anything else, not retried).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sentinel import procs
from sentinel.fsutil import UnsafePath, read_trusted, write_json_atomic

log = logging.getLogger("sentinel.backends")

#: Every reason Sentinel writes into a scheduler starts with this: it is how an uncordon tells
#: Sentinel's drain from an admin's.
REASON_PREFIX = "sentinel:"


class BackendError(RuntimeError):
    """A backend call failed; the message is one sentence naming the call."""

    retry = False


class Unreachable(BackendError):
    """The scheduler did not answer in time, refused the connection, or failed on its side."""

    retry = True


class PermissionDenied(BackendError):
    """The scheduler refused: the message names the RBAC verb or Slurm privilege that is missing."""


class UnknownNode(BackendError):
    """The scheduler does not know this node's name."""


@dataclass(frozen=True)
class CordonReason:
    """Why Sentinel cordons: the policy trip that started the migration."""

    rule: str
    gpu: int
    message: str
    request_id: str = ""
    uuid: str = ""

    def short(self, limit: int = 120) -> str:
        """``sentinel: <rule> gpu<N> <message>``, one printable ASCII line of at most ``limit``."""
        where = "node" if self.gpu < 0 else f"gpu{self.gpu}"
        text = f"{REASON_PREFIX} {self.rule} {where} {self.message}"
        text = re.sub(r"[^\x20-\x7e]", "?", text).replace('"', "'")
        return text[:limit]


@dataclass(frozen=True)
class CordonState:
    cordoned: bool  # the scheduler keeps new work off the node
    by_sentinel: bool  # ... because Sentinel said so (not, or not only, an admin)
    detail: str = ""  # the reason/taints as the scheduler shows them


@dataclass(frozen=True)
class Fleet:
    """What the circuit breaker counts: the nodes in scope and when Sentinel cordoned each."""

    nodes: int
    sentinel_cordons: tuple[tuple[str, float], ...]  # (node, wall time cordoned)


@dataclass(frozen=True)
class Verdict:
    """The circuit breaker's answer for this node (:mod:`sentinel.backends.breaker`)."""

    allowed: bool
    recent: int  # Sentinel cordons in the window, this node excluded
    nodes: int
    why: str


@dataclass
class BackendContext:
    """What a backend may use; injectable so tests run fixture trees and fake processes."""

    node: str
    state_dir: Path
    runtime_dir: Path
    timeout: float
    wall: Callable[[], float]
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run
    signal_agent: Callable[[procs.AgentRecord, int], None] = procs.signal_agent
    read_agent: Callable[[Path], procs.AgentRecord] | None = None
    env: dict[str, str] | None = None  # environment of the commands run (None: the daemon's)


def read_cordon(path: Path) -> tuple[dict | None, str]:
    """(marker, "") for a valid cordon marker; (None, problem) for a file that must not be
    trusted (symlink, wrong owner, not JSON, fields missing); (None, "") when there is none."""
    try:
        raw = read_trusted(path, owners=frozenset({0, os.geteuid()}))
    except FileNotFoundError:
        return None, ""
    except (UnsafePath, OSError) as exc:
        return None, f"untrusted cordon marker: {exc}"
    try:
        marker = json.loads(raw)
    except ValueError:
        return None, f"cordon marker {path} is not JSON"
    if not isinstance(marker, dict) or not all(isinstance(marker.get(k), str) for k in ("node", "reason", "request_id")):
        return None, f"cordon marker {path} lacks node/reason/request_id"
    return marker, ""


class Backend:
    """The file backend's behaviour, which every backend builds on: the local cordon marker and
    the agent stopped through its pidfile. Subclasses add the scheduler's side."""

    name = "file"
    has_scheduler = False  # cordon_scheduler/uncordon_scheduler/scheduler_state talk to a scheduler
    has_fleet = False  # fleet() counts other nodes (the circuit breaker applies)

    def __init__(self, actions, ctx: BackendContext) -> None:
        self.cfg = actions
        self.ctx = ctx
        self.node = ctx.node
        self.pidfile = Path(actions.agent_pidfile) if actions.agent_pidfile else ctx.runtime_dir / "agent.pid"
        self.read_agent = ctx.read_agent or (lambda p: procs.read_agent_record(p, owners=frozenset({0, os.geteuid()})))
        self.notes: list[str] = []  # what the last call did, for the migration record
        self.spare_choice = None  # the last start_spare's SpareChoice, when it chose by distance
        self.domain_refusal = ""  # the level ("nvlink", "leaf") of the last claim's per-domain refusal

    @property
    def cordon_path(self) -> Path:
        return self.ctx.state_dir / "cordon.json"

    # -- the interface ----------------------------------------------------------------------------
    def check(self) -> None:
        return None

    def cordon(self, reason: CordonReason) -> None:
        self.write_marker(reason)
        self.cordon_scheduler(reason)

    def uncordon(self) -> str:
        said = self.uncordon_scheduler() if self.has_scheduler else ""
        removed = self.remove_marker()
        local = f"{self.cordon_path}: cordon cleared" if removed else f"{self.cordon_path}: not cordoned"
        return f"{said}; {local}" if said else local

    def is_cordoned(self) -> CordonState:
        return self.scheduler_state() if self.has_scheduler else self.marker_state()

    def marker_state(self) -> CordonState:
        marker, problem = read_cordon(self.cordon_path)
        if marker is not None:
            return CordonState(True, True, marker["reason"])
        if problem:  # fail safe: a marker nobody can read still keeps the agent off
            return CordonState(True, False, problem)
        return CordonState(False, False)

    def stop_agent(self) -> str:
        try:
            agent = self.read_agent(self.pidfile)
        except FileNotFoundError:
            return f"no agent to stop: {self.pidfile} does not exist"
        except (procs.NotTrusted, OSError) as exc:
            raise BackendError(f"agent not stopped: {exc}") from None
        try:
            self.ctx.signal_agent(agent, signal.SIGTERM)
        except ProcessLookupError:
            return f"agent pid {agent.pid} had already exited"
        except procs.NotTrusted as exc:
            raise BackendError(f"agent not stopped: {exc}") from None
        return f"sent SIGTERM to torchrun agent pid {agent.pid}"

    def start_spare(self) -> str:
        return "the file backend starts no spare (the job's elastic rendezvous waits for one)"

    def fleet(self, now: float) -> Fleet | None:
        return None

    def claim_cordon(self, reason: CordonReason) -> Verdict:
        """The scheduler's cordon under the circuit breaker, atomically: a backend with a fleet
        view cordons only when that keeps Sentinel's recent cordons within
        ``breaker_max_fraction`` however many nodes try at the same moment (Slurm: drain, then
        recount, the deterministic loser resumes itself; Kubernetes: a resourceVersion-checked
        Lease). A refusal leaves nothing of Sentinel's on the scheduler. Without a fleet view
        the breaker does not apply and this is :meth:`cordon_scheduler`."""
        self.cordon_scheduler(reason)
        return Verdict(True, 0, 0, "no fleet view: the breaker does not apply")

    def topology(self):
        """The topology as the configured file and the scheduler describe it (merged; checked)."""
        from sentinel import topology

        tc = self.cfg.topology
        readings = topology.read_file(tc.file) if tc.file else []
        if tc.from_scheduler:
            readings += self.scheduler_topology()
        return topology.merge(readings)

    def scheduler_topology(self) -> list:
        """The scheduler's own topology readings (none here)."""
        return []

    def breaker_topology(self):
        """The topology for the per-domain breaker (:func:`sentinel.topology.domain_settle`), or
        None: no limit below 1, or a topology that cannot be read (noted; the fleet-wide breaker
        still holds, and a failing node is never kept from draining by a topology file)."""
        from sentinel import topology

        tc = self.cfg.topology
        self.domain_refusal = ""
        if tc.breaker_max_nvlink_fraction >= 1 and tc.breaker_max_leaf_fraction >= 1:
            return None
        try:
            return self.topology()
        except (topology.TopologyError, BackendError) as exc:
            self.notes.append(f"topology not used by the breaker: {exc}")
            return None

    def domain_limits(self) -> dict[str, float]:
        tc = self.cfg.topology
        return {"nvlink": tc.breaker_max_nvlink_fraction, "leaf": tc.breaker_max_leaf_fraction}

    # -- the scheduler's side (subclasses) --------------------------------------------------------
    def cordon_scheduler(self, reason: CordonReason) -> None:
        """Keep new work off the node in the scheduler; idempotent; never overwrites an admin's."""

    def uncordon_scheduler(self) -> str:
        """Remove exactly what Sentinel added in the scheduler; one line saying what was done."""
        return ""

    def scheduler_state(self) -> CordonState:
        return CordonState(False, False)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    # -- shared helpers -------------------------------------------------------------------------
    def write_marker(self, reason: CordonReason) -> None:
        marker = {"node": self.node, "reason": f"{reason.rule}: {reason.message}", "gpu": reason.gpu,
                  "request_id": reason.request_id, "time": self.ctx.wall(), "backend": self.name}
        write_json_atomic(self.cordon_path, marker)

    def remove_marker(self) -> bool:
        removed = False
        for name in ("cordon.json", "migration.json"):
            try:
                (self.ctx.state_dir / name).unlink()
                removed = True
            except FileNotFoundError:
                pass
        return removed

    def command(self, argv: list[str], what: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` under one total deadline (the backend's timeout: the child is killed when
        it passes, however the output trickles in). stdout/stderr come back as ``str``, decoded
        with replacement and cut to :data:`OUTPUT_LIMIT` characters: a byte a scheduler printed
        that is not UTF-8 is a ``U+FFFD``, never an exception. A timeout is :class:`Unreachable`;
        any other failure to run it is :class:`BackendError`, never an exception of another kind."""
        limit = timeout or self.ctx.timeout
        try:
            r = self.ctx.run(argv, capture_output=True, timeout=limit, env=self.ctx.env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{what}: `{' '.join(argv[:3])} ...` did not finish within {limit:g} s") from None
        except FileNotFoundError:
            raise BackendError(f"{what}: {argv[0]} is not installed (not on PATH)") from None
        except OSError as exc:
            raise BackendError(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from None
        except Exception as exc:  # noqa: BLE001 - whatever the runner raised, it is a failed call
            raise BackendError(f"{what}: `{argv[0]}` failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        rc = r.returncode if isinstance(r.returncode, int) else -1
        return subprocess.CompletedProcess(r.args, rc, decoded(r.stdout), decoded(r.stderr))


#: The most of a scheduler program's output that is read (characters); sinfo for 10,000 nodes is ~1 MB.
OUTPUT_LIMIT = 16 << 20


def decoded(data: bytes | str | None, limit: int = OUTPUT_LIMIT) -> str:
    """A scheduler's output as text: bytes decoded as UTF-8 with replacement, cut to ``limit``."""
    if data is None:
        return ""
    if isinstance(data, (bytes, bytearray)):
        return bytes(data[:limit * 4]).decode("utf-8", "replace")[:limit]
    return str(data)[:limit]


def with_deadline(fn: Callable[[], Any], seconds: float, what: str,
                  abandoned: list[threading.Thread] | None = None) -> Any:
    """``fn()`` under a total deadline: it runs on its own daemon thread, and when ``seconds``
    pass first the caller gets :class:`Unreachable` at once (the thread is abandoned and added
    to ``abandoned``, so the caller can bound how many hang). Any exception ``fn`` raises is
    re-raised as it is."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=target, name="sentinel-backend-call", daemon=True)
    thread.start()
    if not done.wait(seconds):
        if abandoned is not None:
            abandoned.append(thread)
        raise Unreachable(f"{what}: no complete answer within {seconds:g} s (total deadline)")
    if "error" in box:
        raise box["error"]
    return box.get("value")

def replace_node(argv: tuple[str, ...], node: str) -> list[str]:
    return [a.replace("{node}", node) for a in argv]


def as_dict(obj) -> dict:
    return dataclasses.asdict(obj)
