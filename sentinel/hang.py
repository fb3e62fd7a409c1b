"""Hangs: when to suspect one, who the culprit is, and what the evidence says. Pure logic.

Nothing here does I/O, reads the clock or imports torch: the trainer side
(:mod:`trainer.progress`) gathers what each rank last entered and hands it in; the daemon side
reads the verdict out of a rank's ``hang`` report (:mod:`sentinel.channel`).

The culprit rule
----------------
Every rank that can still talk reports what it last entered: the last step it *completed*, and
per process group the sequence number of the last collective it *entered* (torch's flight
recorder ``collective_seq_id``; for gloo and NCCL alike in torch >= 2.8, see
:func:`parse_flight_recorder`). A hung synchronous job has the healthy ranks waiting inside the
collective with the highest sequence number of the training group; so:

1. a rank that did not answer at all (its process stopped — SIGSTOP, a D-state wait, a dead
   host — or exited) is the culprit: kind ``stopped``;
2. otherwise the ranks whose entered sequence on that group is *below* the highest one never
   reached the collective the others wait in: kind ``not_entered`` (stuck in compute, in a
   data loader, in a deadlock of their own);
3. otherwise every rank is inside the same collective: the fault is in the transport (a link, a
   switch, a GPU that stopped progressing a kernel). The flight recorder cannot tell which;
   NCCL's RAS report can (:func:`parse_ras_report`), else the verdict is ``unknown`` with the
   evidence, and nobody is handed over on a guess.

Where several groups disagree, the group with the largest spread decides (the training group's
sequence counts are the ones that move every step). A tie between ranks is kept: all of them are
named, grouped by host, and a node is handed over only if every culprit rank is on it or the
caller chooses to hand over all of them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

DEFAULT_FLOOR_SECONDS = 30.0
DEFAULT_P99_MULTIPLE = 5.0
MIN_SECONDS = 1.0  # a configured timeout lower than this is refused: scheduling noise alone exceeds it


class HangConfigError(ValueError):
    """A hang setting out of range; the message names the key."""


@dataclass(frozen=True)
class HangSettings:
    """``timeout_seconds``: a fixed T (0: derive it); ``p99_multiple`` x the recent p99 step
    time, floored at ``floor_seconds``, when it is derived. ``gather_seconds``: how long ranks
    that can still talk wait for each other's reports before deciding."""

    timeout_seconds: float = 0.0
    p99_multiple: float = DEFAULT_P99_MULTIPLE
    floor_seconds: float = DEFAULT_FLOOR_SECONDS
    gather_seconds: float = 5.0

    def __post_init__(self) -> None:
        for key in ("timeout_seconds", "p99_multiple", "floor_seconds", "gather_seconds"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise HangConfigError(f"hang.{key} must be a finite number >= 0 (got {v!r})")
        if self.timeout_seconds and self.timeout_seconds < MIN_SECONDS:
            raise HangConfigError(f"hang.timeout_seconds must be 0 (derived) or >= {MIN_SECONDS} (got {self.timeout_seconds})")
        if not self.timeout_seconds and self.floor_seconds < MIN_SECONDS:
            raise HangConfigError(f"hang.floor_seconds must be >= {MIN_SECONDS} (got {self.floor_seconds})")
        if self.p99_multiple < 1:
            raise HangConfigError(f"hang.p99_multiple must be >= 1 (got {self.p99_multiple})")
        if not 0 < self.gather_seconds <= 600:
            raise HangConfigError(f"hang.gather_seconds must be in (0, 600] (got {self.gather_seconds})")


ENV_KEYS = {"timeout_seconds": "SENTINEL_HANG_TIMEOUT_SECONDS", "p99_multiple": "SENTINEL_HANG_P99_MULTIPLE",
            "floor_seconds": "SENTINEL_HANG_FLOOR_SECONDS", "gather_seconds": "SENTINEL_HANG_GATHER_SECONDS"}


def settings_from_env(env: Mapping[str, str]) -> HangSettings:
    """HangSettings from ``SENTINEL_HANG_*`` variables (the trainer side has no config file);
    a bad value raises :class:`HangConfigError` naming the variable."""
    kw: dict[str, float] = {}
    for key, var in ENV_KEYS.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        try:
            kw[key] = float(raw)
        except ValueError:
            raise HangConfigError(f"{var}: not a number (got {raw!r})") from None
    try:
        return HangSettings(**kw)
    except HangConfigError as exc:
        key = str(exc).split(" ", 1)[0].removeprefix("hang.")
        raise HangConfigError(f"{ENV_KEYS.get(key, key)}: {str(exc).split(' ', 1)[1]}") from None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100.0 * len(xs)) - 1))
    return xs[k]


def hang_timeout(step_seconds: Sequence[float], settings: HangSettings = HangSettings()) -> float:
    """T: how long no rank may finish a step before a hang is suspected.

    A configured ``timeout_seconds`` wins. Otherwise ``p99_multiple`` x the p99 of the recent
    step times, never below ``floor_seconds`` (and the floor alone while there are no step times:
    the first step, compile and warm-up included, is not a hang)."""
    if settings.timeout_seconds:
        return float(settings.timeout_seconds)
    if not step_seconds:
        return float(settings.floor_seconds)
    return max(float(settings.floor_seconds), settings.p99_multiple * percentile(step_seconds, 99))


@dataclass(frozen=True)
class Entered:
    """What one rank last entered, as it reports it when a hang is suspected."""

    rank: int
    host: str
    pid: int
    step: int  # the last step it completed (-1: none yet)
    seqs: Mapping[str, int] = field(default_factory=dict)  # process group name -> last collective seq entered
    ops: Mapping[str, str] = field(default_factory=dict)  # process group name -> that collective's name
    idle_seconds: float = 0.0  # since it last completed a step

    def encode(self) -> bytes:
        return json.dumps({"rank": self.rank, "host": self.host, "pid": self.pid, "step": self.step,
                           "seqs": dict(self.seqs), "ops": dict(self.ops),
                           "idle_seconds": round(self.idle_seconds, 3)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> "Entered":
        """Raises ValueError for anything but a well-formed report."""
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a hang report: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError("not a hang report: not an object")
        try:
            rank, host, pid, step = d["rank"], d["host"], d["pid"], d["step"]
            seqs, ops = d.get("seqs", {}), d.get("ops", {})
            idle = d.get("idle_seconds", 0.0)
        except KeyError as exc:
            raise ValueError(f"hang report without {exc}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (rank, pid, step)) or not isinstance(host, str):
            raise ValueError("hang report fields of the wrong type")
        if not isinstance(seqs, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in seqs.items()):
            raise ValueError("hang report seqs must map group names to integers")
        if not isinstance(ops, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ops.items()):
            raise ValueError("hang report ops must map group names to strings")
        if not isinstance(idle, (int, float)) or isinstance(idle, bool):
            raise ValueError("hang report idle_seconds must be a number")
        return cls(rank, host, pid, step, dict(seqs), dict(ops), float(idle))


@dataclass(frozen=True)
class Verdict:
    """``kind``: ``stopped`` (culprits did not answer), ``not_entered`` (they answered but never
    reached the collective the others wait in), ``behind`` (same collective counts, but an older
    completed step), or ``unknown`` (all inside the same collective: not decidable from here)."""

    kind: str
    culprits: tuple[int, ...]
    hosts: tuple[str, ...]
    evidence: str
    group: str = ""
    waiting_seq: int | None = None

    @property
    def decided(self) -> bool:
        return self.kind != "unknown" and bool(self.culprits)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "culprits": list(self.culprits), "hosts": list(self.hosts),
                "evidence": self.evidence, "group": self.group, "waiting_seq": self.waiting_seq}

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> "Verdict":
        d = json.loads(data)
        return cls(d["kind"], tuple(d["culprits"]), tuple(d["hosts"]), d["evidence"], d.get("group", ""),
                   d.get("waiting_seq"))


def _ranges(ranks: Iterable[int]) -> str:
    xs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def find_culprit(reports: Mapping[int, Entered | None], world: int, hosts: Mapping[int, str] | None = None) -> Verdict:
    """The culprit of a hang from the reports of every rank (None or missing: it did not answer).

    ``hosts`` maps rank -> host for the ranks that may not answer (published at start); a
    report's own host wins. Pure: the same reports give the same verdict on every rank."""
    if world < 1:
        raise ValueError("world must be >= 1")
    hosts = dict(hosts or {})
    answered = {r: e for r, e in reports.items() if e is not None and 0 <= r < world}
    for r, e in answered.items():
        hosts[r] = e.host

    def host_list(ranks: Iterable[int]) -> tuple[str, ...]:
        return tuple(sorted({hosts.get(r, "?") for r in ranks}))

    silent = [r for r in range(world) if r not in answered]
    if silent and answered:
        return Verdict("stopped", tuple(silent), host_list(silent),
                       f"rank(s) {_ranges(silent)} on {', '.join(host_list(silent))} did not answer within the gather "
                       f"window (process stopped or gone); {len(answered)} rank(s) answered")
    if not answered:
        return Verdict("unknown", (), (), "no rank answered")
    # Rule 2: the group whose entered sequence numbers spread the most.
    groups = sorted({g for e in answered.values() for g in e.seqs})
    best: tuple[int, str] | None = None
    for g in groups:
        vals = [e.seqs.get(g, 0) for e in answered.values()]
        spread = max(vals) - min(vals)
        if spread > 0 and (best is None or spread > best[0]):
            best = (spread, g)
    if best is not None:
        g = best[1]
        top = max(e.seqs.get(g, 0) for e in answered.values())
        behind = sorted(r for r, e in answered.items() if e.seqs.get(g, 0) < top)
        waiting = sorted(r for r, e in answered.items() if e.seqs.get(g, 0) == top)
        op = next((answered[r].ops.get(g, "") for r in waiting if answered[r].ops.get(g)), "")
        last = {answered[r].seqs.get(g, 0) for r in behind}
        return Verdict("not_entered", tuple(behind), host_list(behind),
                       f"rank(s) {_ranges(waiting)} wait in collective #{top}{' (' + op + ')' if op else ''} of group "
                       f"{g}; rank(s) {_ranges(behind)} on {', '.join(host_list(behind))} last entered "
                       f"#{'/'.join(str(s) for s in sorted(last))}", group=g, waiting_seq=top)
    steps = {e.step for e in answered.values()}
    if len(steps) > 1:
        newest = max(steps)
        behind = sorted(r for r, e in answered.items() if e.step < newest)
        return Verdict("behind", tuple(behind), host_list(behind),
                       f"every rank entered the same collectives, but rank(s) {_ranges(behind)} on "
                       f"{', '.join(host_list(behind))} completed an older step than {newest}")
    return Verdict("unknown", (), (), f"all {len(answered)} rank(s) are in the same collective at step "
                   f"{next(iter(steps))}: the transport, not a rank (see NCCL RAS on GPU nodes)")


# ---------------------------------------------------------------------------------------------
# torch's flight recorder
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupTrace:
    """One process group in a flight recorder dump, from this rank's view."""

    pg_id: str
    name: str
    last_entered: int  # the highest collective_seq_id recorded
    last_op: str
    last_completed: int | None  # None: the backend does not record completion (gloo)
    created_ns: Mapping[int, int] = field(default_factory=dict)  # seq -> time_created_ns


def parse_flight_recorder(dump: str | bytes | Mapping[str, Any]) -> dict[str, GroupTrace]:
    """``torch._C._distributed_c10d._dump_fr_trace_json()`` (or its parsed dict, or the unpickled
    ``_dump_fr_trace()``, which has tuples for lists) -> per process group what this rank last
    entered. Keys are the group names (``default_pg`` for the world group; torch names other
    groups by their id). Raises ValueError for anything else.

    Entries in state ``scheduled`` were entered; NCCL also records ``started`` and ``completed``
    (``time_discovered_completed_ns`` > 0); gloo only records ``scheduled`` entries, with
    ``retired`` set once they finished. P2P entries (``is_p2p``) count separately and are left out."""
    if isinstance(dump, (str, bytes)):
        try:
            dump = json.loads(dump)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a flight recorder dump: {exc}") from None
    if not isinstance(dump, Mapping) or not isinstance(dump.get("entries", []), list):
        raise ValueError("not a flight recorder dump: no entries list")
    out: dict[str, dict[str, Any]] = {}
    for e in dump.get("entries", []):
        if not isinstance(e, Mapping) or e.get("is_p2p"):
            continue
        seq = e.get("collective_seq_id")
        pg = e.get("process_group")
        if not isinstance(seq, int) or not isinstance(pg, (list, tuple)) or len(pg) != 2:
            raise ValueError(f"flight recorder entry without collective_seq_id/process_group: {dict(e)}")
        pg_id, name = str(pg[0]), str(pg[1])
        key = name if name not in ("", "undefined") else pg_id
        g = out.setdefault(key, {"pg_id": pg_id, "last": 0, "op": "", "done": None, "created": {}})
        if seq >= g["last"]:
            g["last"], g["op"] = seq, str(e.get("profiling_name", ""))
        g["created"][seq] = int(e.get("time_created_ns", 0) or 0)
        completed = (e.get("state") == "completed" or (e.get("time_discovered_completed_ns") or 0) > 0
                     or e.get("retired") is True)
        if completed:
            g["done"] = max(g["done"] or 0, seq)
    return {k: GroupTrace(v["pg_id"], k, v["last"], v["op"], v["done"], v["created"]) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# NCCL RAS (NCCL >= 2.24, ``ncclras`` or a plain TCP read of localhost:28028)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RasRank:
    rank: int
    gpu: int | None
    pid: int
    node: str


@dataclass(frozen=True)
class RasIssue:
    """One per-communicator (``#<group>-<comm> (<hash>) <KIND>``) or job-level block."""

    kind: str  # INCOMPLETE | MISMATCH | ... as NCCL prints it
    comm: str  # "0-0", or "" for a job-level block
    lines: tuple[str, ...]
    ranks: tuple[RasRank, ...]  # the ranks the block names
    counts: tuple[tuple[int, int], ...] = ()  # MISMATCH: (ranks, launched up to operation)


@dataclass(frozen=True)
class RasReport:
    nccl_version: str
    nodes: int | None
    processes: int | None
    groups: tuple[dict[str, Any], ...]
    issues: tuple[RasIssue, ...]

    def suspects(self) -> tuple[RasRank, ...]:
        """The ranks NCCL points at: those missing from a communicator (INCOMPLETE: process
        stopped or unreachable), else for a MISMATCH the ranks in the smallest group of operation
        counts when it is *behind* the others (the ones the rest wait for). When the smaller
        group is ahead (NCCL lists the minority, as in NVIDIA/nccl#1911), the laggards are not
        named in the report: nothing is returned for that block."""
        out: list[RasRank] = []
        for issue in self.issues:
            if issue.kind == "INCOMPLETE":
                out.extend(issue.ranks)
            elif issue.kind == "MISMATCH" and issue.counts and issue.ranks:
                named = len(issue.ranks)
                listed = [c for c in issue.counts if c[0] == named]
                if listed and listed[0][1] == min(op for _, op in issue.counts):
                    out.extend(issue.ranks)
        ranked = {(r.pid, r.node) for r in out if r.rank >= 0}
        seen: set[tuple[int, int, str]] = set()
        unique = []
        for r in out:
            if r.rank < 0 and (r.pid, r.node) in ranked:
                continue  # the job-level block names a process its communicator block names with its rank
            if (r.rank, r.pid, r.node) not in seen:
                seen.add((r.rank, r.pid, r.node))
                unique.append(r)
        return tuple(unique)

    def suspect_nodes(self) -> tuple[str, ...]:
        return tuple(sorted({r.node for r in self.suspects()}))


_RANK_LINE = re.compile(r"^\s*Rank (\d+) -- GPU (\d+) managed by process (\d+) on node (\S+)\s*$")
_PROC_LINE = re.compile(r"^\s*Process (\d+) on node (\S+) managing GPU (\d+)\s*$")
_COMM_HEAD = re.compile(r"^#(\d+-\d+) \(([0-9a-f]+)\) ([A-Z_,]+)\s*$")
_LAUNCHED = re.compile(r"^\s*(\d+) ranks? ha(?:ve|s) launched up to operation (\d+)\s*$")
_GROUP_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+(\S+)\s*$")


class RasParseError(ValueError):
    pass


def parse_ras_report(text: str) -> RasReport:
    """The text report NCCL's RAS thread serves on ``localhost:28028`` (what ``ncclras``
    prints). Raises :class:`RasParseError` when the text is not one (no ``Job summary``)."""
    lines = text.splitlines()
    if not any(line.strip() == "Job summary" for line in lines):
        raise RasParseError("not an NCCL RAS report (no 'Job summary' section)")
    version = ""
    m = next((re.search(r"NCCL version (\S+)", line) for line in lines if "NCCL version" in line), None)
    if m:
        version = m.group(1)
    nodes = processes = None
    groups: list[dict[str, Any]] = []
    issues: list[RasIssue] = []
    section = ""
    current: dict[str, Any] | None = None

    def close() -> None:
        nonlocal current
        if current is not None:
            issues.append(RasIssue(current["kind"], current["comm"], tuple(current["lines"]),
                                   tuple(current["ranks"]), tuple(current["counts"])))
            current = None

    for i, line in enumerate(lines):
        s = line.strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if nxt and set(nxt) == {"="} and s:
            close()
            section = s.split("...")[0].strip()
            continue
        if set(s) == {"="}:
            continue
        if section == "Job summary":
            # the "(total)" table: its header line is followed by one row of numbers
            if "(total)" in s and i + 1 < len(lines):
                nums = lines[i + 1].split()
                if nums and all(n.isdigit() for n in nums) and len(nums) >= 3:
                    header = s.split()
                    nodes = int(nums[0])
                    # "Nodes Processes GPUs Processes GPUs" (one row) or "Nodes Processes GPUs" (totals table)
                    processes = int(nums[3]) if len(nums) == 5 else int(nums[1]) if header.count("(total)") >= 2 else None
        elif section == "Communicators":
            g = _GROUP_ROW.match(line)
            if g:
                groups.append({"group": int(g[1]), "comms": int(g[2]), "nodes_per_comm": int(g[3]),
                               "ranks_per_node": int(g[4]), "ranks_per_comm": int(g[5]), "ranks_in_group": int(g[6]),
                               "status": g[7], "errors": [] if g[8] == "OK" else g[8].split(",")})
        elif section in ("Errors", "Warnings"):
            head = _COMM_HEAD.match(s)
            if head:
                close()
                current = {"kind": head[3], "comm": head[1], "lines": [], "ranks": [], "counts": []}
                continue
            if s and s.isupper() and re.fullmatch(r"[A-Z_,]+", s):
                close()
                current = {"kind": s, "comm": "", "lines": [], "ranks": [], "counts": []}
                continue
            if current is None or not s:
                continue
            current["lines"].append(s)
            r = _RANK_LINE.match(line)
            if r:
                current["ranks"].append(RasRank(int(r[1]), int(r[2]), int(r[3]), r[4]))
                continue
            p = _PROC_LINE.match(line)
            if p:
                current["ranks"].append(RasRank(-1, int(p[3]), int(p[1]), p[2]))
                continue
            c = _LAUNCHED.match(line)
            if c:
                current["counts"].append((int(c[1]), int(c[2])))
    close()
    return RasReport(version, nodes, processes, tuple(groups), tuple(issues))
