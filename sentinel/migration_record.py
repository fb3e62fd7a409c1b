"""A migration's persisted record and its phases (what ``migration.json`` holds), and what
other processes read of it: why a node is leaving (:func:`leaving_reason`, asked by the agent
before it re-joins the rendezvous) and the file backend's operator uncordon. The state machine
that moves a record through its phases is :class:`sentinel.migration.Migrator`.

Phases (:class:`Phase`), the only transitions allowed (:data:`ALLOWED`)::

    TRIPPED      --the migrate request leaves at once, before any scheduler call------------> REQUESTED
    REQUESTED    --every rank committed / the ranks exited / the deadline passed / no rank--> ACKNOWLEDGED
    ACKNOWLEDGED --marker written and the backend's cordon claimed under the breaker--------> CORDONED
    ACKNOWLEDGED --the breaker refuses: the marker is removed, nothing is cordoned-----------> REFUSED
    CORDONED     --agent stopped (or drain disabled)----------------------------------------> DRAINED
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from sentinel.backends.base import read_cordon
from sentinel.families import counter, gauge
from sentinel.fsutil import UnsafePath, read_trusted


# the migration's metric families (rendered from sentinel.migration.Migrator's counts)
MIGRATION_STEPS = counter("sentinel_migration_steps", "Migration steps and their failures, by step", "step")
BACKEND_CALLS = counter("sentinel_backend_calls",
                        "Calls to the action backend (scheduler), by backend, operation and outcome (ok, retried, failed)",
                        "backend", "op", "outcome")
BREAKER_REFUSALS = counter("sentinel_breaker_refusals",
                           "Cordons the circuit breaker refused", "backend")
NODE_CORDONED = gauge("sentinel_node_cordoned", "1 while this node is cordoned by Sentinel")
BACKEND_UP = gauge("sentinel_backend_up",
                   "1 when the last call to the action backend's scheduler answered, 0 when it did not", "backend")
SPARE_CHOICES = counter("sentinel_spare_choices",
                        "Spares chosen by topology, by distance to this node (nvlink, leaf, spine, ..., far, unknown)",
                        "distance")
DEADLINE_EXCEEDED = counter("sentinel_migration_deadline_exceeded",
                            "Migrations moved on (fail-safe) past a phase's deadline",
                            "phase")


class Phase(str, enum.Enum):
    """A migration's phase; the module docstring lists the transitions."""

    TRIPPED = "tripped"
    REFUSED = "refused"
    REQUESTED = "requested"
    ACKNOWLEDGED = "acknowledged"
    CORDONED = "cordoned"
    DRAINED = "drained"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.TRIPPED: frozenset({Phase.REQUESTED}),
    Phase.REFUSED: frozenset(),
    Phase.REQUESTED: frozenset({Phase.ACKNOWLEDGED}),
    Phase.ACKNOWLEDGED: frozenset({Phase.CORDONED, Phase.REFUSED}),
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
    reason_long: str = ""  # the text sent to the ranks: "<rule>: <message> (<where>)"
    scheduler_cordoned: bool | None = None  # None: not tried yet; False: the backend's cordon failed (retried)
    spare: dict | None = None  # the spare chosen by distance: node, distance, rank, why (sentinel.topology)


def leaving_reason(state_dir: Path) -> str:
    """Why this node is leaving the job, or "" when it is not: a cordon marker (or one that cannot
    be trusted: fail safe, as ``sentinel launch`` does), or a migration record in any phase (from
    the trip on, every path of a migration ends with the node drained). The agent asks this
    before it re-joins the rendezvous after its workers failed: a node being drained must not
    come back as a participant for the seconds until its own drain signal arrives."""
    if not os.access(state_dir, os.X_OK):
        return ""  # the job's user (sentinel launch --user) may not look: torch's own behaviour
    cordon = state_dir / "cordon.json"
    if cordon.exists() and not os.access(cordon, os.R_OK):
        return "node is cordoned (its cordon marker exists but this user cannot read it)"
    marker, problem = read_cordon(cordon)
    if marker is not None:
        return f"node is cordoned: {marker['reason']}"
    if problem:
        return f"node is cordoned ({problem})"
    try:
        raw = read_trusted(state_dir / "migration.json", owners=frozenset({0, os.geteuid()}), max_bytes=1 << 20)
    except (FileNotFoundError, PermissionError):
        return ""  # none, or not this user's to read: torch's own behaviour
    except (UnsafePath, OSError) as exc:
        return f"untrusted migration record: {exc}"
    try:
        record = json.loads(raw)
        phase = Phase(record["phase"])
    except (ValueError, KeyError, TypeError):
        return "unreadable migration record"
    return f"migration {record.get('request_id', '?')} is {phase.value}: {record.get('rule', '')}: {record.get('reason', '')}"


def uncordon(state_dir: Path) -> bool:
    """Operator action (file backend): clear the cordon marker and the finished migration record.
    ``sentinel uncordon`` goes through the configured backend (:meth:`Backend.uncordon`)."""
    removed = False
    for name in ("cordon.json", "migration.json"):
        try:
            (state_dir / name).unlink()
            removed = True
        except FileNotFoundError:
            pass
    return removed
