"""Migration: snapshot -> acknowledgements -> cordon -> stop the node's torchrun agent.

The sequence is persisted in ``<state_dir>/migration.json`` *before* each step acts (the trip is
on disk before the first request leaves), so a daemon that restarts mid-way resumes it — and
re-sends a pending request under the same id — instead of forgetting the fault or starting a
second migration. The cordon marker ``<state_dir>/cordon.json`` outlives daemon restarts and
reboots: the agent unit's ``ExecCondition=`` refuses to start while it exists, and only an
operator clears it (``sentinel uncordon``).

A write that fails (full or read-only disk) never stops a migration: the node is still cordoned
through the backend and the agent still stopped; the failure is logged and counted
(``sentinel_migration_steps_total{step="state_write_failed"}``) and kept in memory.

Cordon, drain and spare go through the configured backend (:mod:`sentinel.backends`: file,
command, Slurm, Kubernetes) on a worker thread, never on the daemon's loop, so the systemd
watchdog keeps being pinged while ``scontrol`` or the API server is slow. Each call is bounded by
``command_timeout_seconds``; a call the scheduler did not answer is retried with exponential
backoff (``scheduler_attempts``, ``scheduler_backoff_seconds``), and a cordon that still failed is
retried at later polls (backoff doubling up to 5 min) until the scheduler takes it. Every call is
counted (``sentinel_backend_calls_total{backend,op,outcome}``) and ``sentinel_backend_up`` says
whether the last one reached the scheduler. Every deadline is on the monotonic clock; wall-clock
times are only recorded.

Phases and their only transitions: :class:`sentinel.migration_record.Phase`.

A migration's first act is the snapshot request to the node's verified ranks: nothing runs
before it (no scheduler call, no breaker count). The circuit breaker (:mod:`sentinel.backends.breaker`)
is part of the cordon, after the acknowledgements: :meth:`Backend.claim_cordon` counts and cordons
atomically (Slurm: drain, then recount, the deterministic loser resumes itself; Kubernetes: a
resourceVersion-checked Lease), so a burst of trips on many nodes never cordons more than the
fraction. A refusal leaves the node uncordoned and the agent running; the ranks, which committed
their snapshot, go on training once their hold passes. When the scheduler cannot answer, the
migration goes ahead: the node is failing, and a cordon that cannot reach the scheduler cannot
drain the fleet either.

Every phase that waits on a backend call has a deadline the tick enforces
(:attr:`Migrator.phase_deadline_seconds`), whatever the call does: past it, the call is abandoned
and the migration moves on in the fail-safe direction (ACKNOWLEDGED -> CORDONED with the local
marker, the scheduler's cordon retried later; CORDONED -> DRAINED), counted in
``sentinel_migration_deadline_exceeded_total{phase}`` and alerted (``SentinelMigrationDeadline``).

The deadline: ``ack_timeout_seconds`` for the ranks to answer at all ("staged" acks carry the
snapshot's size), extended once every expected rank has staged by the time the staged bytes need
at ``snapshot_min_bytes_per_second`` (at most :data:`MAX_EXTENSION_SECONDS` more; an ack claiming more
than ``channel.MAX_ACK_BYTES`` for one rank is malformed and ignored). The migrate request tells the ranks to hold at least
``hold_seconds`` (the longest the daemon may take to drain after their commit).

The agent is stopped as a whole with SIGTERM, through a pidfd, and only when the pidfile's
identity (pid, start time, executable, uid) still matches (:mod:`sentinel.procs`) — or with
``agent_stop_command``. torchrun forwards SIGTERM to the workers and exits *without* closing the
rendezvous, so the surviving agents re-form it with a spare.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from sentinel import procs
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig
from sentinel.backends import SETTINGS as backend_settings
from sentinel.backends import make_backend
from sentinel.backends.base import (Backend, BackendContext, BackendError, CordonReason, Verdict,
                                    read_cordon)
from sentinel.fsutil import UnsafePath, read_trusted, write_json_atomic
from sentinel.log import event
from sentinel.migration_record import (ALLOWED, BACKEND_CALLS, BACKEND_UP, BREAKER_REFUSALS,  # noqa: F401 (re-exported)
                                       DEADLINE_EXCEEDED, MIGRATION_STEPS, NODE_CORDONED, SPARE_CHOICES, BadTransition,
                                       MigrationRecord, Phase, leaving_reason, uncordon)

log = logging.getLogger("sentinel.migration")
# The most the staged acks can add to the ack deadline, whatever sizes the ranks claim: a rank's
# ack is the job's word, and the job must not be able to hold a failing node for days.
MAX_EXTENSION_SECONDS = 3600.0


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
        backend: Backend | None = None,
        sleep: Callable[[float], None] = time.sleep,
        wake: Callable[[], None] | None = None,
        backend_up: bool | None = None,
    ) -> None:
        self.cfg = actions
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.node = node
        self.wall = wall
        self.clock = clock or (wall if wall is not time.time else time.monotonic)
        self.sleep = sleep
        self.wake = wake or (lambda: None)  # the daemon's loop: a finished backend call is acted on at once
        self._own_workers = workers is None  # replaced when a call is abandoned at its deadline
        self.workers = workers or self._new_workers()
        self.pidfile = Path(actions.agent_pidfile) if actions.agent_pidfile else runtime_dir / "agent.pid"
        self.backend = backend or make_backend(actions, BackendContext(
            node=node, state_dir=state_dir, runtime_dir=runtime_dir, timeout=actions.command_timeout_seconds,
            wall=wall, run=run, signal_agent=signal_agent, read_agent=read_agent))
        self.record: MigrationRecord | None = None
        self.counts: dict[str, int] = {}
        self.calls: dict[tuple[str, str], int] = {}  # (op, outcome) -> backend calls
        self.backend_up = backend_up  # did the last backend call reach the scheduler? (None: no scheduler, or not asked yet)
        self.breaker_refusals = 0
        self.deadline_exceeded: dict[str, int] = {}  # phase -> migrations moved on past its deadline
        self.spare_distances: dict[str, int] = {}  # spares chosen, by distance to this node
        self._job: concurrent.futures.Future | None = None
        self._job_deadline = 0.0  # monotonic: when the tick stops waiting for self._job
        self._requested_at = 0.0  # monotonic
        self._deadline = 0.0
        self._extended = False
        self._cordoned_mem = False
        self._resend = False
        self._retry_at = 0.0  # monotonic: next retry of a failed scheduler cordon
        self._retry_delay = 0.0
        self.cordon_problem = ""
        self._persisted = False  # the record reached the disk: its removal means `sentinel uncordon`
        self._save_lock = threading.Lock()  # the loop and a step's thread save: the last file is the newest
        self.returned_to_service = 0
        self._restore()

    def reconfigure(self, actions: ActionsConfig) -> None:
        """SIGHUP: new timeouts and commands apply from now on (a running step keeps its own).
        The backend itself (``actions.backend`` and each backend's ``[actions.<name>]`` table)
        changes only with a restart (:data:`sentinel.config.RESTART_ONLY`)."""
        self.cfg = actions
        kept = {name: getattr(self.backend.cfg, name) for name in backend_settings}
        self.backend.cfg = dataclasses.replace(actions, backend=self.backend.cfg.backend, **kept)
        self.backend.ctx.timeout = actions.command_timeout_seconds
        if actions.agent_pidfile:
            self.pidfile = Path(actions.agent_pidfile)
            self.backend.pidfile = self.pidfile

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
            self._persisted = True
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, UnsafePath) as exc:
            self.record = None
            event(log, "unreadable migration record ignored", logging.ERROR, error=str(exc))
            return
        if self.record.phase == Phase.DRAINED.value and self.record.scheduler_cordoned is False:
            self._retry_at = self.clock()  # the scheduler never took the cordon: try again now
        if self.active:
            self.record.notes.append("daemon restarted mid-migration; resuming, not starting a second one")
            event(log, "resuming migration after restart", request_id=self.record.request_id, phase=self.record.phase)
            self._requested_at = self.clock()
            self._deadline = self._requested_at + self.cfg.ack_timeout_seconds
            self._resend = self.record.phase == Phase.REQUESTED.value
            self._save()
            if self.record.phase == Phase.TRIPPED.value:  # the request had not left: it leaves now
                self._request()

    def _save(self) -> None:
        if self.record is None:
            return
        try:
            with self._save_lock:
                write_json_atomic(self.record_path, asdict(self.record))
            self._persisted = True
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
        return self.record is not None and self.record.phase not in (Phase.DRAINED.value, Phase.REFUSED.value)

    @property
    def call_budget_seconds(self) -> float:
        """The longest one backend operation may take: every attempt times out, with backoff between."""
        n = self.cfg.scheduler_attempts
        return n * self.cfg.command_timeout_seconds + self.cfg.scheduler_backoff_seconds * (2 ** (n - 1) - 1)

    @property
    def hold_seconds(self) -> float:
        """How long a rank must hold after its commit for the drain to find it holding: the ack
        timeout, then the cordon phase and the agent stop phase at their deadlines."""
        return self.cfg.ack_timeout_seconds + 2 * self.phase_deadline_seconds

    def _reason(self, rec: MigrationRecord) -> CordonReason:
        return CordonReason(rec.rule, rec.gpu, rec.reason, rec.request_id)

    @property
    def phase_deadline_seconds(self) -> float:
        """How long the tick waits for one phase's backend step (the cordon with its breaker
        claim, the agent stop) before it moves on without it."""
        return self.call_budget_seconds + 10.0

    @staticmethod
    def _new_workers() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="sentinel-action")

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        job = self.workers.submit(fn)
        job.add_done_callback(lambda _f: self.wake())
        return job

    def check_returned_to_service(self) -> bool:
        """True once, when ``sentinel uncordon`` returned this node to service while the daemon
        runs: the finished migration's record and the cordon marker are gone from the state
        directory. Only root can remove them: the daemon refused to start unless the state
        directory is root's and writable by nobody else (:func:`sentinel.daemon.check_directories`),
        so no other user can fake an uncordon. The daemon then forgets the finished migration and
        the in-memory cordon, and the next failure is handled like the first. A migration still
        under way is not cut short (it writes its record again at its next step); a record that
        never reached the disk (full or read-only disk) keeps the node cordoned until a restart."""
        rec = self.record
        if rec is None or self.active or not self._persisted or self._job is not None:
            return False
        if self.record_path.exists() or self.cordon_path.exists():
            return False
        event(log, "node returned to service (sentinel uncordon); the next failure migrates again",
              request_id=rec.request_id, node=self.node)
        self.record = None
        self._persisted = False
        self._cordoned_mem = False
        self._retry_at = 0.0
        self._retry_delay = 0.0
        self.returned_to_service += 1
        self._count("returned_to_service")
        return True

    def _start_step(self, fn: Callable[[], Any]) -> None:
        self._job = self._submit(fn)
        self._job_deadline = self.clock() + self.phase_deadline_seconds

    def _abandon_step(self, rec: MigrationRecord) -> None:
        """The phase's backend step did not finish by its deadline: stop waiting for it, count
        and log it. Later steps get fresh workers, never queued behind the hung one."""
        self._job = None
        self.deadline_exceeded[rec.phase] = self.deadline_exceeded.get(rec.phase, 0) + 1
        rec.notes.append(f"{rec.phase}: the backend step did not finish within {self.phase_deadline_seconds:g} s; "
                         f"moving on without it")
        event(log, "migration phase deadline passed; moving on", logging.ERROR, request_id=rec.request_id,
              phase=rec.phase, backend=self.backend.name, deadline_seconds=self.phase_deadline_seconds)
        if self._own_workers:
            self.workers.shutdown(wait=False, cancel_futures=True)
            self.workers = self._new_workers()

    # -- the sequence ---------------------------------------------------------------------------
    def begin(self, request_id: str, trip: Any) -> None:
        if self.cordoned or self.active:
            self._count("already_migrating")
            return
        self.record = MigrationRecord(request_id, self.node, trip.gpu, trip.rule, trip.message, phase=Phase.TRIPPED.value)
        self.record.reason_long = f"{trip.rule}: {trip.message} ({trip.where})"
        self.record.times["tripped"] = self.wall()
        self._save()  # the trip is on disk before anything acts on it
        self._count("started")
        self._request()  # the first act: nothing (no scheduler call, no breaker count) comes before it

    def _request(self) -> None:
        rec = self.record
        assert rec is not None
        self._mark(Phase.REQUESTED)
        self._requested_at = self.clock()
        self._deadline = self._requested_at + self.cfg.ack_timeout_seconds
        self._extended = False
        if rec.rule == "hang":
            # The ranks here are the stuck ones: a snapshot request would wait out the ack
            # timeout. The job's other ranks abandoned the collective and resume from the memory
            # tier (trainer.progress); hand the node over at once.
            rec.ranks = 0
            rec.notes.append("hang: no snapshot asked of the stuck ranks; the job resumes from its memory tier")
            self._save()
            event(log, "migration without a snapshot (hang)", request_id=rec.request_id, node=self.node)
            self._submit(self._start_spare)
            return
        rec.ranks = self.endpoint.request("migrate", rec.request_id, rec.reason_long, hold_seconds=self.hold_seconds,
                                          retry_seconds=self.cfg.ack_timeout_seconds)
        self._save()
        event(log, "migration requested", request_id=rec.request_id, node=self.node, ranks=rec.ranks)
        self._submit(self._start_spare)  # not awaited: the spare warms up while the snapshot is written

    def _refuse(self, why: str) -> None:
        """The circuit breaker is open: no cordon, no drain. The ranks had the migrate request
        first, so the snapshot is taken; they go on training once their hold passes."""
        rec = self.record
        assert rec is not None
        self.breaker_refusals += 1
        self._cordoned_mem = False
        rec.notes.append(f"circuit breaker open, not cordoning: {why}; the job's snapshot was requested first")
        self._mark(Phase.REFUSED)
        event(log, "circuit breaker open: refusing to cordon; the snapshot was requested first", logging.ERROR,
              request_id=rec.request_id, node=self.node, backend=self.backend.name, why=why, ranks=rec.ranks)

    def tick(self, acks: list | None = None) -> None:
        """Advance an active migration with the acknowledgements received this poll. Never blocks."""
        self._retry_cordon()
        if not self.active:
            return
        rec = self.record
        assert rec is not None
        if rec.phase == Phase.TRIPPED.value:  # (only after a failed start) the request leaves now
            self._request()
        if self._resend:  # restarted mid-request: the same id again; a holding rank answers at once
            self._resend = False
            rec.ranks = max(rec.ranks, self.endpoint.request("migrate", rec.request_id, rec.reason_long,
                                                             hold_seconds=self.hold_seconds,
                                                             retry_seconds=self.cfg.ack_timeout_seconds))
        if rec.phase == Phase.REQUESTED.value:
            self._collect(rec, acks or [])
        if self._job is not None:
            result = None
            if not self._job.done():
                if self.clock() <= self._job_deadline:
                    return
                self._abandon_step(rec)  # fail safe: cordoned locally, the scheduler's cordon retried later
                if rec.phase == Phase.ACKNOWLEDGED.value:
                    self._cordoned_mem = True
                    if read_cordon(self.cordon_path)[0] is None:  # the step may not have written it yet
                        try:
                            self.backend.write_marker(self._reason(rec))
                        except OSError as exc:
                            self._count("state_write_failed")
                            rec.notes.append(f"cordon marker not written ({exc.strerror or exc}); cordoned in memory")
                    if rec.scheduler_cordoned is None and self.backend.has_scheduler:
                        rec.scheduler_cordoned = False
                        self._retry_at = self.clock()
            else:
                job, self._job = self._job, None
                try:
                    result = job.result()
                except Exception as exc:  # noqa: BLE001 - an action never stops the sequence
                    rec.notes.append(f"{rec.phase} step failed: {exc}")
                    self._count("action_failed")
                    event(log, "migration action failed", logging.ERROR, phase=rec.phase, error=str(exc))
            if rec.phase == Phase.ACKNOWLEDGED.value and isinstance(result, Verdict) and not result.allowed:
                self._refuse(result.why)
                return
            self._mark(Phase.CORDONED if rec.phase == Phase.ACKNOWLEDGED.value else Phase.DRAINED)
        if rec.phase == Phase.ACKNOWLEDGED.value:
            self._start_step(self._cordon)
        elif rec.phase == Phase.CORDONED.value:
            if self.cfg.drain:
                self._start_step(self._stop_agent)
            else:
                self._mark(Phase.DRAINED)

    def _retry_cordon(self) -> None:
        """A drained node whose scheduler cordon failed: retry it, backing off up to 5 min; a
        retry that hangs past the phase deadline is abandoned (and retried later)."""
        rec = self.record
        if rec is None or rec.phase != Phase.DRAINED.value:
            return
        if self._job is not None:
            if self._job.done():
                self._job = None
            elif self.clock() > self._job_deadline:
                self._abandon_step(rec)
            return
        if rec.scheduler_cordoned is not False or self.clock() < self._retry_at:
            return
        self._retry_delay = min(300.0, max(self.cfg.scheduler_backoff_seconds, 1.0, 2 * self._retry_delay))
        self._retry_at = self.clock() + self._retry_delay
        self._start_step(self._cordon_scheduler)

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
            rec.staged_bytes = sum(a.bytes for a in state.staged.values())  # each bounded by channel.MAX_ACK_BYTES
            extra = min(MAX_EXTENSION_SECONDS, rec.staged_bytes / self.cfg.snapshot_min_bytes_per_second)
            self._deadline = max(self._deadline, now + self.cfg.ack_timeout_seconds + extra)
            self._extended = True
        gone = {pid for pid in sent - acked_pids if not procs.running(pid)}
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
        """Tests and shutdown: wait for the running backend step (bounded)."""
        if self._job is not None:
            concurrent.futures.wait([self._job], timeout=timeout)

    # -- actions (worker thread) ----------------------------------------------------------------
    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One backend operation: an unanswered call is retried with exponential backoff; a
        refusal (permission, unknown node) is not. Counted per outcome; raises the last error."""
        delay = self.cfg.scheduler_backoff_seconds
        scheduler = op != "stop_agent" and self.backend.has_scheduler  # the agent is stopped locally
        for attempt in range(1, self.cfg.scheduler_attempts + 1):
            try:
                try:
                    result = fn(*args)
                except BackendError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a bug or an answer nobody foresaw: a failed call
                    raise BackendError(f"{self.backend.name} {op}: {type(exc).__name__}: {str(exc)[:200]}") from exc
            except BackendError as exc:
                if scheduler:
                    self.backend_up = not exc.retry
                last = attempt == self.cfg.scheduler_attempts or not exc.retry
                self.calls[(op, "failed" if last else "retried")] = self.calls.get((op, "failed" if last else "retried"), 0) + 1
                event(log, f"{self.backend.name} {op} failed" + ("" if last else "; retrying"),
                      logging.ERROR if last else logging.WARNING, backend=self.backend.name, op=op,
                      attempt=attempt, error=str(exc))
                if last:
                    raise
                self.sleep(delay)
                delay *= 2
                continue
            if scheduler:
                self.backend_up = True
            self.calls[(op, "ok")] = self.calls.get((op, "ok"), 0) + 1
            return result
        raise AssertionError("unreachable")  # the loop returns or raises

    def _cordon(self) -> Verdict | None:
        rec = self.record
        assert rec is not None
        self._cordoned_mem = True
        try:
            self.backend.write_marker(self._reason(rec))
        except OSError as exc:
            self._count("state_write_failed")
            rec.notes.append(f"cordon marker not written ({exc.strerror or exc}); cordoned through the backend only")
            event(log, "cannot write the cordon marker; the node is cordoned in memory and through the backend",
                  logging.ERROR, path=str(self.cordon_path), error=exc.strerror or str(exc))
        verdict = self._cordon_scheduler()
        if verdict is not None and not verdict.allowed and rec.phase == Phase.ACKNOWLEDGED.value:
            # the breaker refused (and the tick did not move on without this step): nothing of Sentinel's stays
            self._cordoned_mem = False
            try:
                self.cordon_path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                rec.notes.append(f"cordon marker not removed after the breaker refused: {exc.strerror or exc}")
        return verdict

    def _cordon_scheduler(self) -> Verdict | None:
        """The backend's cordon under the breaker (:meth:`Backend.claim_cordon`); None when the
        backend has no scheduler. A refusal is a verdict, not an error."""
        rec = self.record
        assert rec is not None
        if not self.backend.has_scheduler:
            return None
        try:
            verdict = self._call("cordon", self.backend.claim_cordon, self._reason(rec))
        except BackendError as exc:
            first = rec.scheduler_cordoned is None
            rec.scheduler_cordoned = False
            if first:
                rec.notes.append(f"{self.backend.name} cordon failed ({exc}); retried until it succeeds")
            self._save()
            raise
        rec.notes.extend(self.backend.take_notes())
        if isinstance(verdict, Verdict) and not verdict.allowed and self.backend.domain_refusal:
            self._count(f"domain_breaker_{self.backend.domain_refusal}")  # one NVLink domain / leaf, not the fleet
        if isinstance(verdict, Verdict) and not verdict.allowed:
            if rec.phase == Phase.DRAINED.value:  # a later retry: the node stays drained locally; try again later
                rec.scheduler_cordoned = False
                rec.notes.append(f"circuit breaker refused the scheduler's cordon at a retry: {verdict.why}")
                self._save()
            return verdict
        rec.scheduler_cordoned = True
        self._retry_delay = 0.0
        self._save()
        return verdict if isinstance(verdict, Verdict) else None

    def _stop_agent(self) -> None:
        rec = self.record
        assert rec is not None
        try:
            note = self._call("stop_agent", self.backend.stop_agent)
        except BackendError as exc:
            rec.notes.append(str(exc))
            self._count("agent_untrusted" if "not stopped" in str(exc) else "agent_stop_failed")
            event(log, "agent not stopped", logging.ERROR, pidfile=str(self.pidfile), error=str(exc))
            return
        rec.notes.append(note)
        self._count("agent_stopped" if note.startswith(("sent SIGTERM", "agent_stop command")) else "agent_missing")

    def _start_spare(self) -> None:
        try:
            note = self._call("start_spare", self.backend.start_spare)
        except BackendError as exc:
            note = f"no spare started: {exc}"
        choice = self.backend.spare_choice
        if choice is not None:
            self.spare_distances[choice.distance] = self.spare_distances.get(choice.distance, 0) + 1
        if self.record is not None:
            self.record.notes.append(note)
            self.record.notes.extend(self.backend.take_notes())
            if choice is not None:
                self.record.spare, self.record.times["spare_chosen"] = choice.as_dict(), self.wall()
            self.record.times["spare_called"] = self.wall()  # returned, a spare or not: the record is whole
            self._save()
        event(log, "spare", backend=self.backend.name, result=note,
              **({"spare": choice.node, "distance": choice.distance} if choice is not None else {}))

    FAMILIES = (MIGRATION_STEPS, BACKEND_CALLS, BREAKER_REFUSALS, NODE_CORDONED, BACKEND_UP, DEADLINE_EXCEEDED,
                SPARE_CHOICES)

    def metric_counters(self) -> dict:
        out = {MIGRATION_STEPS.key(step=k): float(v) for k, v in dict(self.counts).items()}
        for (op, outcome), n in dict(self.calls).items():
            out[BACKEND_CALLS.key(backend=self.backend.name, op=op, outcome=outcome)] = float(n)
        out[BREAKER_REFUSALS.key(backend=self.backend.name)] = float(self.breaker_refusals)
        for phase in sorted({Phase.ACKNOWLEDGED.value, Phase.CORDONED.value, *self.deadline_exceeded}):
            out[DEADLINE_EXCEEDED.key(phase=phase)] = float(self.deadline_exceeded.get(phase, 0))
        for distance, n in dict(self.spare_distances).items():
            out[SPARE_CHOICES.key(distance=distance)] = float(n)
        return out

    def gauges(self) -> dict:
        out = {NODE_CORDONED.key(): float(self.cordoned)}
        if self.backend_up is not None:
            out[BACKEND_UP.key(backend=self.backend.name)] = float(self.backend_up)
        return out

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)
