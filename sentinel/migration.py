"""Migration: snapshot -> acknowledgements -> cordon -> stop the node's torchrun agent.

The sequence is persisted in ``<state_dir>/migration.json`` after every phase, so a daemon that
restarts mid-way resumes it instead of starting a second one. The cordon marker
``<state_dir>/cordon.json`` outlives daemon restarts and reboots: the agent unit's
``ExecCondition=`` refuses to start while it exists, and only an operator clears it
(``sentinel uncordon``).

Phases: ``requested`` (migrate sent to the ranks) -> ``acknowledged`` (every rank acked, or the
ack timed out, or no rank was reachable) -> ``cordoned`` -> ``drained`` (agent stopped). The agent
is stopped as a whole with SIGTERM (or ``agent_stop_command``): torchrun forwards it to the
workers and exits *without* closing the rendezvous, so the surviving agents re-form it with a
spare. Stopping only the workers would make torchrun restart them in place.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from sentinel.channel import DaemonEndpoint
from sentinel.config import ActionsConfig
from sentinel.daemon import write_json_atomic
from sentinel.log import event
from sentinel.policy import Trip

log = logging.getLogger("sentinel.migration")


@dataclass
class MigrationRecord:
    request_id: str
    node: str
    gpu: int
    rule: str
    reason: str
    phase: str = "requested"
    times: dict[str, float] = field(default_factory=dict)
    ranks: int = 0
    acks: list[dict] = field(default_factory=list)
    snapshot_step: int | None = None
    snapshot_ok: bool | None = None
    notes: list[str] = field(default_factory=list)


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
        run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        self.cfg = actions
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.node = node
        self.wall = wall
        self.run = run
        self.kill = kill
        self.pidfile = Path(actions.agent_pidfile) if actions.agent_pidfile else runtime_dir / "agent.pid"
        self.record: MigrationRecord | None = None
        self.counts: dict[str, int] = {}
        state_dir.mkdir(parents=True, exist_ok=True)
        self._restore()

    # -- persistence ----------------------------------------------------------------------------
    @property
    def record_path(self) -> Path:
        return self.state_dir / "migration.json"

    @property
    def cordon_path(self) -> Path:
        return self.state_dir / "cordon.json"

    def _restore(self) -> None:
        try:
            data = json.loads(self.record_path.read_text())
            self.record = MigrationRecord(**data)
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as exc:
            event(log, "unreadable migration record ignored", logging.ERROR, error=str(exc))
            return
        if self.record.phase != "drained":
            self.record.notes.append("daemon restarted mid-migration; resuming, not starting a second one")
            event(log, "resuming migration after restart", request_id=self.record.request_id, phase=self.record.phase)
            self._save()

    def _save(self) -> None:
        if self.record is not None:
            write_json_atomic(self.record_path, asdict(self.record))

    def _mark(self, phase: str) -> None:
        assert self.record is not None
        self.record.phase = phase
        self.record.times[phase] = self.wall()
        self._save()
        event(log, f"migration {phase}", request_id=self.record.request_id, node=self.node, phase=phase)

    @staticmethod
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    @property
    def cordoned(self) -> bool:
        return self.cordon_path.exists()

    @property
    def active(self) -> bool:
        return self.record is not None and self.record.phase != "drained"

    # -- the sequence ---------------------------------------------------------------------------
    def begin(self, request_id: str, trip: Trip) -> None:
        if self.cordoned or self.active:
            self._count("already_migrating")
            return
        self.record = MigrationRecord(request_id, self.node, trip.gpu, trip.rule, trip.message)
        self.record.times["tripped"] = self.wall()
        self.record.ranks = self.endpoint.request("migrate", request_id, f"{trip.rule}: {trip.message} (GPU {trip.gpu})")
        self._mark("requested")
        self._count("started")
        if self.cfg.spare_command:
            self._run_command("spare", self.cfg.spare_command)

    def tick(self, acks: list | None = None) -> None:
        """Advance an active migration with the acknowledgements received this poll."""
        if not self.active:
            return
        rec = self.record
        assert rec is not None
        if rec.phase == "requested":
            for ack in acks or []:
                if ack.id == rec.request_id:
                    rec.acks.append(asdict(ack))
                    rec.snapshot_step = ack.step
                    rec.snapshot_ok = ack.ok if rec.snapshot_ok is None else (rec.snapshot_ok and ack.ok)
            state = self.endpoint.requests.get(rec.request_id)
            expected = len(state.sent_to) if state else rec.ranks
            acked_pids = {a["pid"] for a in rec.acks}
            acked = len(acked_pids)
            waited = self.wall() - rec.times["requested"]
            # ranks that exited without acknowledging (the job restarted under them) will never answer
            gone = {pid for pid in (state.sent_to if state else set()) - acked_pids if not self.alive(pid)}
            if expected and acked >= expected:
                self._mark("acknowledged")
            elif expected and acked + len(gone) >= expected:
                rec.notes.append(f"{len(gone)} rank(s) exited before acknowledging; draining without waiting")
                self._mark("acknowledged")
            elif not expected:
                rec.notes.append("no trainer rank reachable on this node; draining without a fresh snapshot")
                self._mark("acknowledged")
            elif waited > self.cfg.ack_timeout_seconds:
                rec.notes.append(f"only {acked}/{expected} ranks acknowledged within {self.cfg.ack_timeout_seconds:g} s")
                self._mark("acknowledged")
            if rec.phase == "acknowledged" and rec.snapshot_ok is False:
                rec.notes.append("the migrate snapshot failed; the job will resume from its previous snapshot")
                self._save()
        if rec.phase == "acknowledged":
            self._cordon()
        if rec.phase == "cordoned":
            if self.cfg.drain:
                self._stop_agent()
            self._mark("drained")

    def _cordon(self) -> None:
        rec = self.record
        assert rec is not None
        marker = {"node": self.node, "reason": f"{rec.rule}: {rec.reason}", "gpu": rec.gpu,
                  "request_id": rec.request_id, "time": self.wall()}
        write_json_atomic(self.cordon_path, marker)
        if self.cfg.cordon_command:
            self._run_command("cordon", self.cfg.cordon_command)
        self._mark("cordoned")

    def _stop_agent(self) -> None:
        rec = self.record
        assert rec is not None
        if self.cfg.agent_stop_command:
            self._run_command("agent_stop", self.cfg.agent_stop_command)
            return
        try:
            pid = int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            rec.notes.append(f"no agent to stop: {self.pidfile}: {exc}")
            self._count("agent_missing")
            return
        try:
            self.kill(pid, signal.SIGTERM)
            rec.notes.append(f"sent SIGTERM to torchrun agent pid {pid}")
            self._count("agent_stopped")
        except ProcessLookupError:
            rec.notes.append(f"agent pid {pid} had already exited")
            self._count("agent_missing")

    def _run_command(self, what: str, argv: tuple[str, ...]) -> None:
        args = [a.replace("{node}", self.node) for a in argv]
        try:
            r = self.run(args, capture_output=True, text=True, timeout=30)
            ok = r.returncode == 0
            self._count(f"{what}_command_{'ok' if ok else 'failed'}")
            if not ok:
                event(log, f"{what} command failed", logging.ERROR, argv=args, rc=r.returncode, stderr=r.stderr[-500:])
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._count(f"{what}_command_failed")
            event(log, f"{what} command failed", logging.ERROR, argv=args, error=str(exc))

    def metric_counters(self) -> dict:
        out = {("sentinel_migration_steps", (("step", k),)): float(v) for k, v in self.counts.items()}
        return out

    def gauges(self) -> dict:
        return {("sentinel_node_cordoned", ()): float(self.cordoned)}


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
