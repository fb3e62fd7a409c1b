"""``backend = "slurm"``: the scheduler owns the node.

* **cordon** — ``scontrol update nodename=<node> state=drain reason="sentinel: <rule> gpu<N> <why>"``
  (LBNL NHC's convention). Running jobs keep running (``draining``), new ones avoid the node, and
  ``sinfo -R`` says why. A node someone else already drained keeps that drain and its reason.
* **uncordon** — ``state=resume``, only when the drain reason is Sentinel's (starts
  ``sentinel:``); an admin's drain is left alone and said so.
* **spare** — a node of the job's own allocation that runs no ranks, the nearest to this one in
  the topology (``scontrol show topology`` and ``[actions.topology] file``: same NVLink block,
  else same leaf switch, else same spine), none that another failing node of the job has named
  already: the daemon records it in *its own node's* Comment
  (``sentinel-spare=<node>[,<next nearest>...];for=<this node>;job=<job>;distance=<leaf>``; one
  record per failing node, so two nodes of one job failing at once never overwrite each other's,
  as they did in the job's Comment, and two records naming one spare still give two spares, the
  batch script taking each record's first node still idle; an admin's node Comment is left alone
  and no record is made) and signals the batch
  script of the job this node's agent runs in (the running job on this node of the
  agent's user, from the verified pidfile; ``scancel --batch --signal=USR1``), and
  ``deploy/slurm/train.sbatch`` starts an agent on an idle, undrained node of its allocation,
  as the job's user. Nothing outside the allocation is touched.
* **fleet** (circuit breaker) — ``sinfo`` over this node's partitions (or ``[actions.slurm]
  partition``): the nodes, and the drains whose reason is Sentinel's with their times.

The daemon is root (or the SlurmUser, or a user with ``AdminLevel=Operator``): draining is an
operator's privilege, and a refusal says so. ``daemon.node_name`` must be the Slurm NodeName
(checked at start); several ``slurmd`` may share one host name.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sentinel import procs, settings
from sentinel.backends.base import (REASON_PREFIX, Backend, BackendError, CordonReason, CordonState, Fleet,
                                    PermissionDenied, Unreachable, UnknownNode, Verdict)
from sentinel.backends.breaker import settle
from sentinel.topology import domain_settle

PRIVILEGE = ("draining or resuming a node needs root, the SlurmUser, or an AdminLevel of Operator or Admin "
             "(sacctmgr modify user <user> set adminlevel=Operator)")
_DENIED = re.compile(r"invalid user id|access/permission denied|permission denied|not authorized|authentication failure",
                     re.I)
_UNKNOWN = re.compile(r"invalid node name|node \S+ not found|not found", re.I)
_UNREACHABLE = re.compile(r"unable to contact slurm controller|socket timed out|connection refused|"
                          r"communication connection failure|slurm_load_.*error|zero bytes were transmitted|"
                          r"slurmctld.*(not responding|down)|send/recv operation|timed out", re.I)


#: A job id as squeue/scontrol print it: ``1234``, an array task ``1234_7`` or ``1234_[1-3,5%2]``,
#: a heterogeneous component ``1234+0``. Anything else (a leading ``-``, spaces) never reaches a command.
JOB_ID = re.compile(r"^[0-9]{1,10}(?:_(?:[0-9]{1,10}|\[[0-9,%-]{1,64}\]))?(?:\+[0-9]{1,5})?$")
NODE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
#: The spare record a failing node's daemon keeps in that node's own Comment (train.sbatch reads it).
#: ``sentinel-spare=<spare>[,<next>...];for=<node>;job=<job>;distance=<d>``: the spares in order of
#: preference (at most SPARE_RECORD_NODES), so that two records naming one spare still give two.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
SPARE_RECORD = re.compile(rf"^sentinel-spare=({_NAME}(?:,{_NAME}){{0,3}});for=({_NAME});job=([0-9_+\[\],%-]{{1,96}});"
                          r"distance=([a-z-]{1,16})$")
SPARE_RECORD_NODES = 4
#: How often a node that drained itself counts the partition again while nodes ranked after it undo
#: theirs, and for how long at most (then it undoes its own: the breaker holds).
SETTLE_INTERVAL = 0.5
SETTLE_ROUNDS = 12


def job_id(text: str) -> str | None:
    """``text`` when it is a Slurm job id (:data:`JOB_ID`), else None."""
    return text if JOB_ID.match(text) else None


def parse_node(line: str) -> dict[str, str]:
    """One ``scontrol show node -o`` line as a dict; ``Reason`` keeps its spaces (it is last)."""
    line = line.strip()
    out: dict[str, str] = {}
    head, sep, reason = line.partition(" Reason=")
    for item in head.split():
        key, eq, value = item.partition("=")
        if eq:
            out[key] = value
    if sep:
        out["Reason"] = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason)  # the "[user@time]" Slurm appends
    return out


def environ_value(pid: int, key: str, proc: Path = procs.PROC, limit: int = 1 << 20) -> str | None:
    """``key``'s value in a process's environment (its owner wrote it: a claim, never proof), or None."""
    try:
        with open(proc / str(pid) / "environ", "rb") as f:
            raw = f.read(limit)
    except OSError:
        return None
    prefix = key.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode("utf-8", "replace")
    return None


def drained(node: dict[str, str]) -> bool:
    return "DRAIN" in node.get("State", "").upper().split("+")


@dataclass(frozen=True)
class SlurmSettings:
    """``[actions.slurm]``: how the daemon reaches Slurm (read when ``actions.backend = \"slurm\"``)."""

    # The Slurm client programs (PATH is searched); SLURM_CONF in the daemon's environment picks the cluster.
    scontrol: str = "scontrol"
    squeue: str = "squeue"
    scancel: str = "scancel"
    sinfo: str = "sinfo"
    # The circuit breaker's scope: this partition's nodes ("" = every partition this node is in).
    partition: str = ""
    # How a spare is started: this signal goes to the batch script of the job running on the node
    # (deploy/slurm/train.sbatch traps it and starts an agent on an idle node of its allocation).
    spare_signal: str = "USR1"

    def validate(self, prefix: str) -> None:
        for key in ("scontrol", "squeue", "scancel", "sinfo"):
            settings.text(prefix, key, getattr(self, key))
            if not getattr(self, key):
                raise settings.ConfigError(f"{prefix}.{key}: must name the program, not be empty")
        settings.text(prefix, "partition", self.partition)
        if self.spare_signal not in ("USR1", "USR2", "URG", "CONT"):
            raise settings.ConfigError(f"{prefix}.spare_signal: must be one of USR1, USR2, URG, CONT "
                                       f"(got {settings.printable(self.spare_signal)!r})")


SETTINGS = SlurmSettings


class SlurmBackend(Backend):
    name = "slurm"
    has_scheduler = True
    has_fleet = True

    def __init__(self, actions, ctx, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(actions, ctx)
        self.s = actions.slurm
        self.sleep = sleep
        if not NODE_NAME.match(self.node):  # it is an argument of scontrol/squeue: never an option
            raise BackendError(f"daemon.node_name {self.node[:64]!r} is not a Slurm NodeName (letters, digits, '.', '_', '-', "
                               f"not starting with '-')")

    # -- scontrol ----------------------------------------------------------------------------------
    def _slurm(self, what: str, *argv: str) -> str:
        r = self.command(list(argv), what)
        if r.returncode == 0:
            return r.stdout
        msg = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()[-1][:300]
        shown = " ".join(argv[:4])
        if _DENIED.search(msg):
            raise PermissionDenied(f"Slurm refused `{shown}`: {msg}; {PRIVILEGE}")
        if _UNKNOWN.search(msg):
            raise UnknownNode(f"node {self.node!r} is not known to Slurm (`{shown}`: {msg}); set daemon.node_name "
                              f"to this node's Slurm NodeName")
        if _UNREACHABLE.search(msg):
            raise Unreachable(f"slurmctld did not answer `{shown}`: {msg}")
        raise BackendError(f"`{shown}` failed: {msg}")

    def show(self) -> dict[str, str]:
        node = parse_node(self._slurm("scontrol show node", self.s.scontrol, "show", "node", self.node, "-o"))
        if node.get("NodeName") != self.node:
            raise UnknownNode(f"node {self.node!r} is not known to Slurm (scontrol show node printed no such node); "
                              f"set daemon.node_name to this node's Slurm NodeName")
        return node

    # -- the interface ----------------------------------------------------------------------------
    def check(self) -> None:
        self.show()

    def cordon_scheduler(self, reason: CordonReason) -> None:
        node = self.show()
        current = node.get("Reason", "")
        if drained(node) and not current.startswith(REASON_PREFIX):
            self.notes.append(f"slurm: {self.node} was already drained by someone else ({current!r}); left as it is")
            return
        self._slurm("scontrol update", self.s.scontrol, "update", f"nodename={self.node}", "state=drain",
                    f"reason={reason.short()}")
        self.notes.append(f"slurm: drained {self.node} (reason {reason.short()!r})")

    def uncordon_scheduler(self) -> str:
        node = self.show()
        reason = node.get("Reason", "")
        if not drained(node):
            return f"slurm: {self.node} is not drained (state {node.get('State', '?')})"
        if not reason.startswith(REASON_PREFIX):
            return f"slurm: {self.node} is drained by someone else ({reason!r}); left alone"
        self._slurm("scontrol update", self.s.scontrol, "update", f"nodename={self.node}", "state=resume")
        if node.get("Comment", "").startswith("sentinel-spare="):  # its spare record served its job
            self._slurm("scontrol update node", self.s.scontrol, "update", f"nodename={self.node}", "comment=")
        return f"slurm: {self.node} resumed (it was Sentinel's drain: {reason!r})"

    def scheduler_state(self) -> CordonState:
        node = self.show()
        reason = node.get("Reason", "")
        return CordonState(drained(node), drained(node) and reason.startswith(REASON_PREFIX), reason)

    def start_spare(self) -> str:
        """Signal the batch script of the job this node's agent belongs to, and no other: the
        agent comes from the root-owned, verified pidfile; the job must be a running job on this
        node of the agent's own user. A job of another user, or one running here with no agent
        of Sentinel's, never receives the signal (its batch script would die of an untrapped
        SIGUSR1)."""
        try:
            agent = self.read_agent(self.pidfile)
        except FileNotFoundError:
            return f"slurm: no agent on {self.node} ({self.pidfile} does not exist); no job to give a spare"
        except (procs.NotTrusted, OSError) as exc:
            raise BackendError(f"slurm: no spare asked for: the agent is not trusted: {exc}") from None
        out = self._slurm("squeue", self.s.squeue, "-h", "-w", self.node, "-t", "RUNNING", "-u", str(agent.uid),
                          "-o", "%A")
        words = out.split()
        jobs = sorted({j for j in words if job_id(j)})
        if len(jobs) != len(set(words)):
            bad = sorted(set(words) - set(jobs))[:3]
            self.notes.append(f"slurm: squeue printed {len(set(words)) - len(jobs)} word(s) that are not job ids "
                              f"({', '.join(repr(b[:40]) for b in bad)}); ignored")
        if len(jobs) > 1:  # the user's own claim may pick among the user's own jobs, nothing more
            claimed = environ_value(agent.pid, "SLURM_JOB_ID")
            jobs = [claimed] if claimed in jobs else jobs
        if not jobs:
            return (f"slurm: the agent (pid {agent.pid}, uid {agent.uid}) runs in no job of its user on {self.node}; "
                    f"no spare to start")
        if len(jobs) > 1:
            raise BackendError(f"slurm: {len(jobs)} jobs of uid {agent.uid} run on {self.node} ({', '.join(jobs)}); "
                               f"cannot tell which one to give a spare")
        if job_id(jobs[0]) is None:  # a claim from the environment is re-checked: it never becomes an option
            raise BackendError(f"slurm: {jobs[0][:40]!r} is not a Slurm job id; no spare asked for")
        choice = self._choose_spare(jobs[0])
        self._slurm("scancel --signal", self.s.scancel, "--batch", f"--signal={self.s.spare_signal}", "--", jobs[0])
        if choice is None:
            return (f"slurm: asked job {jobs[0]}'s batch script (SIG{self.s.spare_signal}) to start an agent on an idle "
                    f"node of its allocation")
        return (f"slurm: asked job {jobs[0]}'s batch script (SIG{self.s.spare_signal}) to start an agent on {choice.node} "
                f"({choice.distance}: {choice.why})")

    def _choose_spare(self, job: str):
        """The idle node of ``job``'s allocation nearest this one that no other failing node of the
        job has named, recorded in this node's Comment for train.sbatch; None (the script picks the
        first idle node, as before) when the allocation has no idle node or the topology cannot be
        read — a spare is never held up by the topology."""
        from sentinel import topology

        self.spare_choice = None
        try:
            alloc = topology.expand_hostlist(self._slurm("squeue", self.s.squeue, "-h", "-j", job, "-o", "%N").strip())
            busy: set[str] = set()
            for line in self._slurm("squeue -s", self.s.squeue, "-h", "-s", "-j", job, "-o", "%i %N").splitlines():
                step, _, nodes = line.strip().partition(" ")
                if step.endswith((".batch", ".extern")) or not nodes:
                    continue
                busy.update(topology.expand_hostlist(nodes))
            bad = set(self._slurm("sinfo", self.s.sinfo, "-h", "-N", "-n", ",".join(alloc) or self.node,
                                  "-t", "drain,drng,down,fail,maint", "-o", "%N").split())
            taken = set(self.spare_records(alloc, job).values())  # another failing node of the job named them first
            idle = [n for n in alloc if n not in busy and n not in bad and n != self.node]
            candidates = [n for n in idle if n not in taken]
            if not candidates:
                return None
            topo = self.topology()
        except (BackendError, topology.TopologyError) as exc:
            self.notes.append(f"slurm: spare chosen by the batch script (first idle node): {exc}")
            return None
        choice = topology.choose_spare(topo, self.node, candidates or idle)
        if choice is None:
            return None
        ranked = [choice.node]  # then the next nearest: the batch script takes the first still idle
        rest = [n for n in candidates if n != choice.node] + [n for n in idle if n in taken and n != choice.node]
        while rest and len(ranked) < SPARE_RECORD_NODES:
            nxt = topology.choose_spare(topo, self.node, rest)
            ranked.append(nxt.node)
            rest.remove(nxt.node)
        try:
            self._record_spare(job, choice, ranked)
        except BackendError as exc:  # the spare is still asked for: the script then takes its first idle node
            self.notes.append(f"slurm: no spare record for {choice.node}: {exc}")
        self.spare_choice = choice
        return choice

    def spare_records(self, nodes: list[str], job: str) -> dict[str, str]:
        """``failing node -> its first spare`` from the spare records of ``job`` in ``nodes``'
        Comments (:data:`SPARE_RECORD`; anything else in a Comment is not a record)."""
        out = self._slurm("sinfo", self.s.sinfo, "-h", "-N", "-n", ",".join(nodes) or self.node,
                          "-O", "NodeList:200,Comment:600")
        records: dict[str, str] = {}
        for line in out.splitlines():
            words = line.split()
            m = SPARE_RECORD.match(words[1]) if len(words) >= 2 else None
            if m and m.group(3) == job and m.group(2) == words[0]:
                records[words[0]] = m.group(1).split(",")[0]
        return records

    def _record_spare(self, job: str, choice, ranked: list[str]) -> None:
        """This node's spare record, in its own Comment: one write that no other node's daemon
        touches (the job's Comment, shared, lost one of two records written at once)."""
        current = self.show().get("Comment", "")
        if current not in ("", "(null)") and not current.startswith("sentinel-spare="):
            self.notes.append(f"slurm: {self.node}'s Comment is someone else's ({current[:80]!r}); no spare record "
                              f"made (the batch script starts its first idle node)")
            return
        self._slurm("scontrol update node", self.s.scontrol, "update", f"nodename={self.node}",
                    f"comment=sentinel-spare={','.join(ranked)};for={self.node};job={job};distance={choice.distance}")

    def scheduler_topology(self) -> list:
        """``scontrol show topology``: empty (not an error) when no topology plugin is configured."""
        from sentinel import topology

        r = self.command([self.s.scontrol, "show", "topology"], "scontrol show topology")
        if r.returncode != 0 or ("SwitchName=" not in r.stdout and "BlockName=" not in r.stdout):
            return []
        return topology.parse_slurm_topology(r.stdout, "scontrol show topology")

    def fleet(self, now: float) -> Fleet:
        partitions = self.s.partition or self.show().get("Partitions", "")
        if not partitions or partitions == "(null)":
            raise BackendError(f"slurm: {self.node} is in no partition; set [actions.slurm] partition")
        out = self._slurm("sinfo", self.s.sinfo, "-h", "-N", "-p", partitions, "-o", "%N|%T|%H|%E")
        nodes: set[str] = set()
        cordons: list[tuple[str, float]] = []
        for line in out.splitlines():
            parts = line.split("|", 3)
            if len(parts) != 4:
                continue  # malformed: skipped (sinfo prints one line per node and partition)
            name, _state, stamp, reason = (p.strip() for p in parts)
            if not name:
                continue
            nodes.add(name)
            if reason.startswith(REASON_PREFIX):
                try:
                    cordons.append((name, time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))))
                except ValueError:
                    cordons.append((name, now))  # a Sentinel drain with no readable time counts as recent
        return Fleet(len(nodes), tuple(sorted(set(cordons))))

    def claim_cordon(self, reason: CordonReason) -> Verdict:
        """Drain, then recount (:func:`sentinel.backends.breaker.settle`): this node's drain goes
        in first, then the partition is counted; the node that ranks past the allowed fraction
        resumes itself, one that ranks within it counts again until the later ones have resumed
        (at most :data:`SETTLE_ROUNDS` times, then it resumes itself). An admin's drain is left
        as it is and not counted as Sentinel's."""
        node = self.show()
        current = node.get("Reason", "")
        if drained(node) and not current.startswith(REASON_PREFIX):
            self.notes.append(f"slurm: {self.node} was already drained by someone else ({current!r}); left as it is")
            return Verdict(True, 0, 0, "drained by someone else: nothing of Sentinel's to count")
        if not drained(node):
            self._slurm("scontrol update", self.s.scontrol, "update", f"nodename={self.node}", "state=drain",
                        f"reason={reason.short()}")
        verdict = None
        topo = self.breaker_topology()
        for _ in range(SETTLE_ROUNDS):
            fleet, now = self.fleet(self.ctx.wall()), self.ctx.wall()
            outcome, verdict = settle(fleet, self.node, now, max_fraction=self.cfg.breaker_max_fraction,
                                      window_seconds=self.cfg.breaker_window_seconds)
            if topo is not None and outcome != "lost":  # and no more than a share of its NVLink domain / leaf
                d_outcome, d = domain_settle(topo, self.node, fleet.sentinel_cordons, now,
                                             window_seconds=self.cfg.breaker_window_seconds,
                                             max_fraction=self.domain_limits())
                if d_outcome != "won":
                    outcome = "lost" if d_outcome == "lost" else "wait"
                    verdict = Verdict(False, verdict.recent, verdict.nodes, d.why)
                    self.domain_refusal = d.level
                else:
                    self.domain_refusal = ""
            if outcome == "won":
                self.notes.append(f"slurm: drained {self.node} (reason {reason.short()!r}); breaker: {verdict.why}")
                return verdict
            if outcome == "lost":
                break
            self.sleep(SETTLE_INTERVAL)
        assert verdict is not None
        self._undo_drain()
        return Verdict(False, verdict.recent, verdict.nodes, verdict.why)

    def _undo_drain(self) -> None:
        """Resume this node after losing the breaker's count, if the drain is still Sentinel's."""
        node = self.show()
        if drained(node) and node.get("Reason", "").startswith(REASON_PREFIX):
            self._slurm("scontrol update", self.s.scontrol, "update", f"nodename={self.node}", "state=resume")


BACKEND = SlurmBackend
