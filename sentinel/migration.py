"""Migration: snapshot -> acknowledgements -> cordon -> stop the node's torchrun agent.

The sequence is persisted in ``<state_dir>/migration.json`` *before* each step acts (the trip is
on disk before the first request leaves), so a daemon that restarts mid-way resumes it — and
re-sends a pending request under the same id — instead of forgetting the fault or starting a
second migration. The cordon marker ``<state_dir>/cordon.json`` outlives daemon restarts and
reboots: the agent unit's ``ExecCondition=`` refuses to start while it exists, and only an
operator clears it (``sentinel uncordon``).

A write that fails (full or read-only disk) never stops a migration: the node is still cordoned
through the configured command and the agent still stopped; the failure is logged and counted
(``sentinel_migration_steps_total{step="state_write_failed"}``) and kept in memory.

Cordon and drain commands run on a worker thread with their own timeout, never on the daemon's
loop, so the systemd watchdog keeps being pinged while ``scontrol`` or ``systemctl stop`` blocks.
Every deadline is on the monotonic clock; wall-clock times are only recorded.

Phases (:class:`Phase`), the only transitions allowed::

    REQUESTED    --every rank committed / the ranks exited / the deadline passed / no rank--> ACKNOWLEDGED
    ACKNOWLEDGED --cordon marker written (or failed, loudly) and cordon command run-----------> CORDONED
    CORDONED     --agent stopped (or drain disabled)----------------------------------------> DRAINED

The deadline: ``ack_timeout_seconds`` for the ranks to answer at all ("staged" acks carry the
snapshot's size), extended once every expected rank has staged by the time the staged bytes need
at ``snapshot_min_bytes_per_second``. The migrate request tells the ranks to hold at least
``hold_seconds`` (the longest the daemon may take to drain after their commit).

The agent is stopped as a whole with SIGTERM, through a pidfd, and only when the pidfile's
identity (pid, start time, executable, uid) still matches (:mod:`sentinel.procs`) — or with
``agent_stop_command``. torchrun forwards SIGTERM to the workers and exits *without* closing the
rendezvous, so the surviving agents re-form it with a spare.
"""

from __future__ import annotations

import concurrent.futures
import enum
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from sentinel import procs
from sentinel.channel import DaemonEndpoint
from sentinel.config import ActionsConfig
from sentinel.fsutil import UnsafePath, read_trusted, write_json_atomic
from sentinel.log import event

log = logging.getLogger("sentinel.migration")


class Phase(str, enum.Enum):
    """A migration's phase; see the module docstring for the transitions."""

    REQUESTED = "requested"
    ACKNOWLEDGED = "acknowledged"
    CORDONED = "cordoned"
    DRAINED = "drained"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.REQUESTED: frozenset({Phase.ACKNOWLEDGED}),
    Phase.ACKNOWLEDGED: frozenset({Phase.CORDONED}),
    Phase.CORDONED: frozenset({Phase.DRAINED}),
    Phase.DRAINED: frozenset(),
}


class BadTransition(RuntimeError):
    pass


@dataclass
class MigrationRecord:
    request_id: str
    node: str
    gpu: int
    rule: str
    reason: str
    phase: str = Phase.REQUESTED.value
    times: dict[str, float] = field(default_factory=dict)  # wall-clock, for humans and benchmarks
    ranks: int = 0
    acks: list[dict] = field(default_factory=list)
    snapshot_step: int | None = None
    snapshot_ok: bool | None = None
    notes: list[str] = field(default_factory=list)
    staged_bytes: int = 0


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


def leaving_reason(state_dir: Path) -> str:
    """Why this node is leaving the job, or "" when it is not: a cordon marker (or one that cannot
    be trusted: fail safe, as ``sentinel launch`` does), or a migration record in any phase (from
    the trip on, every path of a migration ends with the node drained). The agent asks this
    before it re-joins the rendezvous after its workers failed: a node being drained must not
    come back as a participant for the seconds until its own drain signal arrives."""
    marker, problem = read_cordon(state_dir / "cordon.json")
    if marker is not None:
        return f"node is cordoned: {marker['reason']}"
    if problem:
        return f"node is cordoned ({problem})"
    try:
        raw = read_trusted(state_dir / "migration.json", owners=frozenset({0, os.geteuid()}), max_bytes=1 << 20)
    except FileNotFoundError:
        return ""
    except (UnsafePath, OSError) as exc:
        return f"untrusted migration record: {exc}"
    try:
        record = json.loads(raw)
        phase = Phase(record["phase"])
    except (ValueError, KeyError, TypeError):
        return "unreadable migration record"
    return f"migration {record.get('request_id', '?')} is {phase.value}: {record.get('rule', '')}: {record.get('reason', '')}"


class Migrator:
    def __init__(
        self,
        actions: ActionsConfig,
        endpoint: DaemonEndpoint,
        *,
        state_dir: Path,
        runtime_dir: Path,
        node: str,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] | None = None,
        run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
        signal_agent: Callable[[procs.AgentRecord, int], None] = procs.signal_agent,
        read_agent: Callable[[Path], procs.AgentRecord] | None = None,
        workers: concurrent.futures.Executor | None = None,
    ) -> None:
        self.cfg = actions
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.node = node
        self.wall = wall
        self.clock = clock or (wall if wall is not time.time else time.monotonic)
        self.run = run
        self.signal_agent = signal_agent
        self.read_agent = read_agent or (lambda p: procs.read_agent_record(p, owners=frozenset({0, os.geteuid()})))
        self.workers = workers or concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sentinel-action")
        self.pidfile = Path(actions.agent_pidfile) if actions.agent_pidfile else runtime_dir / "agent.pid"
        self.record: MigrationRecord | None = None
        self.counts: dict[str, int] = {}
        self._job: concurrent.futures.Future | None = None
        self._requested_at = 0.0  # monotonic
        self._deadline = 0.0
        self._extended = False
        self._cordoned_mem = False
        self._resend = False
        self.cordon_problem = ""
        # Called (from the worker thread) when a cordon/drain step finishes, so the daemon ticks
        # now instead of at its next poll: each poll interval saved is saved on every migration.
        self.wake: Callable[[], None] = lambda: None
        self._restore()

    def reconfigure(self, actions: ActionsConfig) -> None:
        """SIGHUP: new timeouts and commands apply from now on (a running step keeps its own)."""
        self.cfg = actions
        if actions.agent_pidfile:
            self.pidfile = Path(actions.agent_pidfile)

    # -- persistence ----------------------------------------------------------------------------
    @property
    def record_path(self) -> Path:
        return self.state_dir / "migration.json"

    @property
    def cordon_path(self) -> Path:
        return self.state_dir / "cordon.json"

    def _restore(self) -> None:
        marker, problem = read_cordon(self.cordon_path)
        if problem:
            self.cordon_problem = problem
            self._count("cordon_marker_invalid")
            event(log, "ignoring an invalid cordon marker", logging.ERROR, problem=problem)
            try:
                os.replace(self.cordon_path, self.cordon_path.with_name(f"cordon.json.invalid-{int(self.wall())}"))
            except OSError:
                pass
        try:
            raw = read_trusted(self.record_path, owners=frozenset({0, os.geteuid()}), max_bytes=1 << 20)
            data = json.loads(raw)
            self.record = MigrationRecord(**data)
            Phase(self.record.phase)
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, UnsafePath) as exc:
            self.record = None
            event(log, "unreadable migration record ignored", logging.ERROR, error=str(exc))
            return
        if self.record.phase != Phase.DRAINED.value:
            self.record.notes.append("daemon restarted mid-migration; resuming, not starting a second one")
            event(log, "resuming migration after restart", request_id=self.record.request_id, phase=self.record.phase)
            self._requested_at = self.clock()
            self._deadline = self._requested_at + self.cfg.ack_timeout_seconds
            self._resend = self.record.phase == Phase.REQUESTED.value
            self._save()

    def _save(self) -> None:
        if self.record is None:
            return
        try:
            write_json_atomic(self.record_path, asdict(self.record))
        except OSError as exc:  # a full or read-only disk never stops a migration
            self._count("state_write_failed")
            event(log, "cannot persist the migration record; continuing from memory", logging.ERROR,
                  path=str(self.record_path), error=exc.strerror or str(exc))

    def _mark(self, phase: Phase) -> None:
        assert self.record is not None
        old = Phase(self.record.phase)
        if phase not in ALLOWED[old]:
            raise BadTransition(f"migration {self.record.request_id}: {old.value} -> {phase.value} is not allowed")
        self.record.phase = phase.value
        self.record.times[phase.value] = self.wall()
        self._save()
        event(log, f"migration {phase.value}", request_id=self.record.request_id, node=self.node, phase=phase.value)

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    @property
    def cordoned(self) -> bool:
        return self._cordoned_mem or read_cordon(self.cordon_path)[0] is not None

    @property
    def active(self) -> bool:
        return self.record is not None and self.record.phase != Phase.DRAINED.value

    @property
    def hold_seconds(self) -> float:
        """How long a rank must hold after its commit for the drain to find it holding."""
        return self.cfg.ack_timeout_seconds + 2 * self.cfg.command_timeout_seconds + 10.0

    # -- the sequence ---------------------------------------------------------------------------
    def begin(self, request_id: str, trip: Any) -> None:
        if self.cordoned or self.active:
            self._count("already_migrating")
            return
        self.record = MigrationRecord(request_id, self.node, trip.gpu, trip.rule, trip.message)
        self.record.times["tripped"] = self.wall()
        self.record.times[Phase.REQUESTED.value] = self.wall()
        self._save()  # the trip is on disk before anything acts on it
        self._requested_at = self.clock()
        self._deadline = self._requested_at + self.cfg.ack_timeout_seconds
        self._extended = False
        self.record.ranks = self.endpoint.request("migrate", request_id, f"{trip.rule}: {trip.message} ({trip.where})",
                                                  hold_seconds=self.hold_seconds)
        self._save()
        event(log, "migration requested", request_id=request_id, node=self.node, ranks=self.record.ranks)
        self._count("started")
        if self.cfg.spare_command:
            self.workers.submit(self._run_command, "spare", self.cfg.spare_command)

    def tick(self, acks: list | None = None) -> None:
        """Advance an active migration with the acknowledgements received this poll. Never blocks."""
        if not self.active:
            return
        rec = self.record
        assert rec is not None
        if self._resend:  # restarted mid-request: the same id again; a holding rank answers at once
            self._resend = False
            rec.ranks = max(rec.ranks, self.endpoint.request("migrate", rec.request_id, rec.reason,
                                                             hold_seconds=self.hold_seconds))
        if rec.phase == Phase.REQUESTED.value:
            self._collect(rec, acks or [])
        if self._job is not None:
            if not self._job.done():
                return
            job, self._job = self._job, None
            try:
                job.result()
            except Exception as exc:  # noqa: BLE001 - an action never stops the sequence
                rec.notes.append(f"{rec.phase} step failed: {exc}")
                self._count("action_failed")
                event(log, "migration action failed", logging.ERROR, phase=rec.phase, error=str(exc))
            self._mark(Phase.CORDONED if rec.phase == Phase.ACKNOWLEDGED.value else Phase.DRAINED)
        if rec.phase == Phase.ACKNOWLEDGED.value:
            self._job = self.workers.submit(self._cordon)
        elif rec.phase == Phase.CORDONED.value:
            self._job = self.workers.submit(self._stop_agent) if self.cfg.drain else None
            if self._job is None:
                self._mark(Phase.DRAINED)
        if self._job is not None:
            self._job.add_done_callback(lambda _job: self.wake())

    def _collect(self, rec: MigrationRecord, acks: list) -> None:
        for ack in acks:
            if ack.id != rec.request_id or getattr(ack, "phase", "committed") != "committed":
                continue
            rec.acks.append(asdict(ack))
            rec.snapshot_step = ack.step
            rec.snapshot_ok = ack.ok if rec.snapshot_ok is None else (rec.snapshot_ok and ack.ok)
        state = self.endpoint.requests.get(rec.request_id)
        sent = set(state.sent_to) if state else set()
        expected = len(sent) if state else rec.ranks
        acked_pids = {a["pid"] for a in rec.acks}
        acked = len(acked_pids)
        now = self.clock()
        if state and not self._extended and sent and sent <= set(state.staged) | acked_pids:
            # every rank is alive and writing: give the write the time its size needs
            rec.staged_bytes = sum(a.bytes for a in state.staged.values())
            extra = rec.staged_bytes / self.cfg.snapshot_min_bytes_per_second
            self._deadline = max(self._deadline, now + self.cfg.ack_timeout_seconds + extra)
            self._extended = True
        gone = {pid for pid in sent - acked_pids if not _alive(pid)}
        if expected and acked >= expected:
            self._mark(Phase.ACKNOWLEDGED)
        elif expected and acked + len(gone) >= expected:
            rec.notes.append(f"{len(gone)} rank(s) exited before acknowledging; draining without waiting")
            self._mark(Phase.ACKNOWLEDGED)
        elif not expected:
            rec.notes.append("no trainer rank reachable on this node; draining without a fresh snapshot")
            self._mark(Phase.ACKNOWLEDGED)
        elif now > self._deadline:
            waited = now - self._requested_at
            rec.notes.append(f"only {acked}/{expected} ranks acknowledged within {waited:.0f} s")
            self._mark(Phase.ACKNOWLEDGED)
        if rec.phase == Phase.ACKNOWLEDGED.value and rec.snapshot_ok is False:
            rec.notes.append("the migrate snapshot failed; the job will resume from its previous snapshot")
            self._save()

    def wait_actions(self, timeout: float = 30.0) -> None:
        """Tests and shutdown: wait for the running cordon/drain step (bounded)."""
        if self._job is not None:
            concurrent.futures.wait([self._job], timeout=timeout)

    # -- actions (worker thread) ----------------------------------------------------------------
    def _cordon(self) -> None:
        rec = self.record
        assert rec is not None
        marker = {"node": self.node, "reason": f"{rec.rule}: {rec.reason}", "gpu": rec.gpu,
                  "request_id": rec.request_id, "time": self.wall()}
        self._cordoned_mem = True
        try:
            write_json_atomic(self.cordon_path, marker)
        except OSError as exc:
            self._count("state_write_failed")
            rec.notes.append(f"cordon marker not written ({exc.strerror or exc}); cordoned through the command only")
            event(log, "cannot write the cordon marker; the node is cordoned in memory and through the command",
                  logging.ERROR, path=str(self.cordon_path), error=exc.strerror or str(exc))
        if self.cfg.cordon_command:
            self._run_command("cordon", self.cfg.cordon_command)

    def _stop_agent(self) -> None:
        rec = self.record
        assert rec is not None
        if self.cfg.agent_stop_command:
            self._run_command("agent_stop", self.cfg.agent_stop_command)
            return
        try:
            agent = self.read_agent(self.pidfile)
        except FileNotFoundError:
            rec.notes.append(f"no agent to stop: {self.pidfile} does not exist")
            self._count("agent_missing")
            return
        except (procs.NotTrusted, OSError) as exc:
            rec.notes.append(f"agent not stopped: {exc}")
            self._count("agent_untrusted")
            event(log, "refusing to signal the agent", logging.ERROR, pidfile=str(self.pidfile), error=str(exc))
            return
        try:
            self.signal_agent(agent, signal.SIGTERM)
            rec.notes.append(f"sent SIGTERM to torchrun agent pid {agent.pid}")
            self._count("agent_stopped")
        except ProcessLookupError:
            rec.notes.append(f"agent pid {agent.pid} had already exited")
            self._count("agent_missing")
        except procs.NotTrusted as exc:
            rec.notes.append(f"agent not stopped: {exc}")
            self._count("agent_untrusted")

    def _run_command(self, what: str, argv: tuple[str, ...]) -> None:
        args = [a.replace("{node}", self.node) for a in argv]
        try:
            r = self.run(args, capture_output=True, text=True, timeout=self.cfg.command_timeout_seconds)
            ok = r.returncode == 0
            self._count(f"{what}_command_{'ok' if ok else 'failed'}")
            if not ok:
                event(log, f"{what} command failed", logging.ERROR, argv=args, rc=r.returncode, stderr=r.stderr[-500:])
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._count(f"{what}_command_failed")
            event(log, f"{what} command failed", logging.ERROR, argv=args, error=str(exc))

    def metric_counters(self) -> dict:
        return {("sentinel_migration_steps", (("step", k),)): float(v) for k, v in dict(self.counts).items()}

    def gauges(self) -> dict:
        return {("sentinel_node_cordoned", ()): float(self.cordoned)}

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def uncordon(state_dir: Path) -> bool:
    """Operator action: clear the cordon marker and the finished migration record."""
    removed = False
    for name in ("cordon.json", "migration.json"):
        try:
            (state_dir / name).unlink()
            removed = True
        except FileNotFoundError:
            pass
    return removed
