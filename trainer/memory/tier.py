"""One rank's side of the memory tier: set up the slots, stage snapshots, hand them to the
replicator, and restore (collective) from this node's memory or a peer's replica."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from trainer.memory.holder import Slot, inventory
from trainer.memory.place import ensure_holder, holder_id
from trainer.memory.layout import Layout, copy_all, encode, get_path, local, path_key, walk
from trainer.memory.plan import DISK, RestorePlan, placed_partners, plan_restore
from trainer.memory.replicator import CHUNK, Job, Replicator, collective
from trainer.memory.slot import (
    COMPLETE, EMPTY, OWN, OWN_SLOTS, REPLICA, REPLICA_SLOTS, MemoryBudgetError, MemoryTierError, data_offset,
    parse_name, slot_name,
)

log = logging.getLogger("sentinel.trainer")
METRICS_EVERY = 10.0  # seconds: the metrics file is rewritten at most this often while rounds are skipped
BUDGET_ENV = "SENTINEL_MEMORY_REPLICA_BUDGET"


def _budget_from_env() -> float:
    """The replica budget from the environment: a share of wall-clock time in [0, 1) (0: none)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise MemoryTierError(f"{BUDGET_ENV}={raw!r}: a share of wall-clock time, 0 <= budget < 1 (0: no bound)")
    return value



@dataclass
class RestoreResult:
    """What a restore did, for logs, the progress file and the drill."""

    tier: str  # "memory", or "" when memory had nothing usable (the caller goes to disk)
    step: int = -1
    local: list[int] = field(default_factory=list)  # shards read from this node's memory
    peer: list[int] = field(default_factory=list)  # shards pulled from another node's copy
    disk: list[int] = field(default_factory=list)  # shards read from the disk snapshot of the same step
    reason: str = ""  # why memory was not used
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self, *, from_disk: bool) -> dict[str, Any]:
        """Where the state came from (``from_disk``: the caller loaded a disk snapshot instead)."""
        return {"tier": "memory" if self.tier == "memory" else ("disk" if from_disk else "none"),
                "own": self.local, "peer": self.peer, "disk": self.disk, "memory_reason": self.reason,
                "memory_rejected": self.rejected, "seconds": round(self.seconds, 4)}


class MemoryTier:
    """One rank's side of the memory tier. Collective methods say so; every rank calls them in the
    same order. ``group`` is used by this tier only: by the replicator thread once started, and by
    :meth:`setup`/:meth:`restore` before that (on the training thread, with no thread running)."""

    def __init__(self, directory: str | os.PathLike, *, run_id: str, rank: int, world: int, local_world: int,
                 group: Any, bytes_per_second: float = 0.0, timeout: float = 120.0,
                 metrics_file: str | os.PathLike | None = None, node_name: str | None = None,
                 topology_file: str | os.PathLike | None = None, replica_budget: float | None = None) -> None:
        if local_world < 1 or world % local_world:
            raise MemoryTierError(f"world size {world} is not a whole number of nodes of {local_world} ranks")
        self.dir = ensure_holder(Path(directory))
        self.holder = holder_id(self.dir)
        self.run, self.rank, self.world, self.local_world = run_id, rank, world, local_world
        self.nodes = world // local_world
        # where each node's replicas go: the ring (n + 1) mod N until setup() agrees on a topology's plan
        self.node_name = node_name or os.environ.get("SENTINEL_NODE") or socket.gethostname()
        topology_file = topology_file if topology_file is not None else os.environ.get("SENTINEL_TOPOLOGY", "")
        self.topology_file = str(topology_file)
        self.node_holder: list[int] = [(n + 1) % self.nodes for n in range(self.nodes)]
        self.placement: list[str] = []  # the agreed placement, one line per node (printed by rank 0 at setup)
        self.send_to, self.recv_from = placed_partners(rank, world, local_world, self.node_holder)
        self.group = group
        self.bytes_per_second = bytes_per_second
        self.timeout = timeout
        # the share of wall-clock time replica rounds may take (SENTINEL_MEMORY_REPLICA_BUDGET; 0: none,
        # a round every K steps): a round due within the pause is skipped, the own copy still taken
        self.replica_budget = replica_budget if replica_budget is not None else _budget_from_env()
        self.replica_skipped = 0  # rounds skipped (one running, or the budget's pause), own copy taken
        self._metrics_at = 0.0
        self.metrics_file = Path(metrics_file) if metrics_file else self.dir / f"metrics-rank{rank}.prom"
        self.layout: Layout | None = None
        self.own: list[Slot] = []
        self.replicas: list[Slot] = []
        self.replicator: Replicator | None = None
        self.pinned: Slot | None = None
        self.holders: list[str] = []
        self.snapshots = 0  # memory snapshots handed to the replicator
        self.late = 0  # memory snapshots skipped: a replica copy was still running
        self.disk_only = 0  # steps staged for the disk tier alone (due while a replica copy ran)
        self.stalls: list[float] = []
        # where the stall goes, per snapshot: building the state dict (the caller), choosing the
        # slot and (re)building the copy plan, the tensor copies, the header and meta
        self.stall_parts: dict[str, list[float]] = {"build": [], "plan": [], "copy": [], "meta": []}
        self._plan: tuple[Any, list[torch.Tensor], list[tuple[str, tuple]]] | None = None
        self.held_bytes = 0
        self._cleanup_after_first = False
        self._disk_cache: dict[int, list[Any]] = {}
        if self.nodes == 1:
            log.warning("memory tier on a single node: no peer replica (a node loss falls back to disk)")

    # -- setup ------------------------------------------------------------------------------------
    def need_bytes(self, data_len: int, replica_len: int) -> int:
        off = data_offset()
        return OWN_SLOTS * (off + data_len) + (REPLICA_SLOTS * (off + replica_len) if self.nodes > 1 else 0)

    def setup(self, state: Mapping[str, Any]) -> None:
        """Collective. Lay out the state, check every node's holder has room for its ranks' own
        slots and replica slots (all ranks raise :class:`MemoryBudgetError` together, naming the
        node's holder and the size needed), then create and map the slots and start the replicator."""
        layout = Layout.of(state)
        reusable = sum(self._existing(slot_name(OWN, self.rank, i)) for i in range(OWN_SLOTS))
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        topology_bytes, topology_problem = self._read_topology()
        digest = hashlib.sha256(topology_bytes).hexdigest() if topology_bytes else topology_problem
        mine = (self.holder, str(self.dir), layout.data_len, free, reusable, self.node_name, digest)
        everyone = self._gather(mine)
        self.holders = [e[0] for e in everyone]
        self._place(everyone, topology_bytes)
        replica_len = everyone[self.recv_from][2]
        for r, e in enumerate(everyone):  # every rank judges every holder: one verdict everywhere
            everyone[r] = (*e, everyone[self.partners(r)[1]][2])
        short = []
        for h in dict.fromkeys(self.holders):
            on_h = [e for e in everyone if e[0] == h]
            need = sum(self.need_bytes(e[2], e[7]) for e in on_h)
            have = on_h[0][3] + sum(e[4] for e in on_h)
            if need > have:
                short.append(f"{on_h[0][1]} (node of rank(s) {[r for r in range(self.world) if self.holders[r] == h]}) "
                             f"needs {need / 2**20:.1f} MiB, has {have / 2**20:.1f} MiB free")
        if short:
            raise MemoryBudgetError("memory tier: not enough memory for the in-memory snapshots ("
                                    f"{OWN_SLOTS} own slots + {REPLICA_SLOTS} replica slots per rank): "
                                    + "; ".join(short) + ". Grow /dev/shm (mount -o remount,size=...), point "
                                    "SENTINEL_MEMORY_DIR at a bigger tmpfs, or turn the memory tier off "
                                    "(memory_interval_steps=0)")
        self.layout = layout
        self.own = [self._open(OWN, self.rank, i, layout.data_len) for i in range(OWN_SLOTS)]
        if self.nodes > 1:
            self.replicas = [self._open(REPLICA, self.recv_from, i, replica_len) for i in range(REPLICA_SLOTS)]
        self.held_bytes = sum(s.offset + s.data_len for s in self.own + self.replicas)
        self.replicator = Replicator(self.group, self.send_to, self.recv_from, self.replicas,
                                     bytes_per_second=self.bytes_per_second, timeout=self.timeout,
                                     budget=self.replica_budget)
        self._write_metrics()

    def partners(self, rank: int) -> tuple[int, int]:
        """(send to, receive from) of ``rank`` under the agreed placement."""
        return placed_partners(rank, self.world, self.local_world, self.node_holder)

    def _read_topology(self) -> tuple[bytes, str]:
        if not self.topology_file:
            return b"", ""
        try:
            with open(self.topology_file, "rb") as f:
                return f.read(16 << 20), ""
        except OSError as exc:
            return b"", f"unreadable: {exc.strerror or exc}"

    def _place(self, everyone: list[tuple], topology_bytes: bytes) -> None:
        """Every rank decides from the same gathered facts (node names, the topology file's
        digest as each rank read it), so every rank reaches the same plan: the topology's when
        every rank read the same file and it places the nodes, else the ring."""
        from sentinel import topology

        names = [everyone[n * self.local_world][5] for n in range(self.nodes)]
        digests = {e[6] for e in everyone}
        why = ""
        plan = None
        if not self.topology_file or self.nodes < 2:
            return
        if len(digests) != 1:
            why = f"the ranks read different topology files ({len(digests)} versions; {self.topology_file})"
        elif not topology_bytes:
            why = f"{self.topology_file}: {next(iter(digests))}"
        elif len(set(names)) != len(names):
            why = f"node names are not unique ({names}): set SENTINEL_NODE on each node"
        else:
            try:
                topo = topology.merge(topology.parse_text(topology_bytes.decode(), self.topology_file))
            except (topology.TopologyError, UnicodeDecodeError) as exc:
                why = f"the topology cannot be used: {exc}"
            else:
                plan = topology.replica_plan(topo, names)
                if not plan.topology_used:
                    why = f"{self.topology_file} places none of the job's nodes {names}"
        if plan is not None and plan.topology_used:
            self.node_holder = list(plan.holder)
            self.placement = plan.lines(topo) + [f"replica kept in its own failure domain (no room elsewhere): {n}"
                                                 for n in plan.shared]
        else:
            self.placement = [f"ring (n + 1) mod N: {why}"]
        self.send_to, self.recv_from = self.partners(self.rank)
        if self.rank == 0:  # printed at start, once per job (re)start
            print("sentinel memory tier: replica placement\n  " + "\n  ".join(self.placement), file=sys.stderr, flush=True)

    def _existing(self, name: str) -> int:
        try:
            st = os.lstat(self.dir / name)
        except OSError:
            return 0
        return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() else 0

    def _open(self, role: str, shard: int, i: int, data_len: int) -> Slot:
        slot = Slot(self.dir / slot_name(role, shard, i), data_len)
        state, _, _, meta = slot.header()
        if state != EMPTY and meta.get("run") != self.run:
            slot.invalidate()  # stale memory of another run: never again taken for this one
        return slot

    def _gather(self, obj: Any) -> list[Any]:
        if not collective(self.world):
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _write_metrics(self) -> None:
        """``sentinel_trainer_memory_snapshot_bytes`` in the Prometheus text format, for a
        node_exporter textfile collector (written atomically; this rank's slots only)."""
        own = sum(s.offset + s.data_len for s in self.own)
        rep = sum(s.offset + s.data_len for s in self.replicas)
        text = ("# HELP sentinel_trainer_memory_snapshot_bytes Host memory held by the in-memory snapshot tier\n"
                "# TYPE sentinel_trainer_memory_snapshot_bytes gauge\n"
                f'sentinel_trainer_memory_snapshot_bytes{{rank="{self.rank}",copy="own"}} {own}\n'
                f'sentinel_trainer_memory_snapshot_bytes{{rank="{self.rank}",copy="replica"}} {rep}\n'
                "# HELP sentinel_trainer_memory_replica_skipped_total Replica rounds skipped under the replica budget "
                "(the own copy was taken)\n"
                "# TYPE sentinel_trainer_memory_replica_skipped_total counter\n"
                f'sentinel_trainer_memory_replica_skipped_total{{rank="{self.rank}"}} {self.replica_skipped}\n')
        self._metrics_at = time.monotonic()
        tmp = self.metrics_file.with_name(f".{self.metrics_file.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.metrics_file)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.metrics_file, exc)

    def _maybe_write_metrics(self) -> None:
        if time.monotonic() - self._metrics_at >= METRICS_EVERY:
            self._write_metrics()

    def summary(self, **extra: Any) -> dict[str, Any]:
        """This rank's figures (``extra`` goes in before the holder), for logs and a job's report."""
        def median(xs: list[float]) -> float | None:
            return sorted(xs)[len(xs) // 2] if xs else None

        return {"snapshots": self.snapshots, "late": self.late, "disk_only": self.disk_only,
                "replica_skipped": self.replica_skipped, "replica_budget": self.replica_budget,
                "agreed_step": self.agreed_step, "held_bytes": self.held_bytes,
                "state_bytes": self.layout.data_len if self.layout is not None else None,
                "replica_errors": self.replicator.errors if self.replicator else 0,
                "stall_median_seconds": median(self.stalls),
                "stall_parts_median_seconds": {k: median(v) for k, v in self.stall_parts.items()},
                **extra, "holder": str(self.dir)}

    # -- snapshots ----------------------------------------------------------------------------------
    def link_evidence(self) -> tuple[float, int]:
        """(seconds per MB of the last replica received, the rank it came from): the link from
        ``recv_from`` to this rank, for the straggler logic (``trainer.progress``); (0, -1) before
        the first replica (or on one node)."""
        link = self.replicator.link_in if self.replicator is not None else None
        if link is None or link[0] <= 0 or self.recv_from == self.rank:
            return 0.0, -1
        return link[1] / (link[0] / 1e6), self.recv_from

    def busy(self) -> bool:
        return self.replicator is not None and self.replicator.busy()

    def replica_wait(self) -> bool:
        """No replica round may start now: one is running, or the budget's pause is not over."""
        return self.replicator is not None and self.replicator.pausing()

    def done_step(self) -> int:
        """The newest step whose replica round succeeded on this rank (-1: none)."""
        return self.replicator.done_step() if self.replicator is not None else -1

    def agree(self, step: int) -> None:
        """``step`` is the least :meth:`done_step` of every rank (the guard's all-reduce)."""
        if self.replicator is not None:
            self.replicator.agree(step)

    def take(self, step: int, state: Mapping[str, Any], *, due: bool, replicate: bool, disk: bool,
             reuse: bool = False, build_seconds: float = 0.0, staged: Slot | None = None) -> Slot | None:
        """A step with a memory (``due``) or disk snapshot due: staged and handed to the replicator
        when ``replicate`` (agreed: no rank's round is still running); else the memory snapshot is
        late (counted; the step is never held for it) and the step is staged for the disk tier
        alone when ``disk``. ``staged``: this step's own copy, already taken (:meth:`stage`, the
        guard takes it while the ranks agree); a late one then stays this rank's own copy."""
        if replicate:
            return self.snapshot(step, state, reuse=reuse, build_seconds=build_seconds, staged=staged).slot
        if due and not disk and self.replica_budget > 0 and (staged is not None or self._free_slot() is not None):
            self.replica_skipped += 1  # the own copy alone: a process crash still loses nothing
            self._maybe_write_metrics()
            return staged if staged is not None else self.stage(step, state, reuse=reuse, build_seconds=build_seconds)
        self.late += int(due)
        if not disk:
            return None
        self.disk_only += 1
        return staged if staged is not None else self.stage(step, state, reuse=reuse, build_seconds=build_seconds)

    def snapshot(self, step: int, state: Mapping[str, Any], *, reuse: bool = False, build_seconds: float = 0.0,
                 staged: Slot | None = None) -> Job:
        """Stage this rank's state at ``step`` into a free own slot (the stall) and hand it to
        the replicator. Call only when no rank is busy (the guard agrees on that first).

        ``reuse``: ``state`` is the same object as at the previous snapshot and its tensors are
        still the live ones (the caller checked); the list of tensors to copy is then reused
        instead of walking the state again. ``build_seconds``: what building ``state`` took the
        caller (counted in the stall). ``staged``: the slot :meth:`stage` already filled with this
        step's state (not staged again)."""
        assert self.replicator is not None
        slot = staged if staged is not None else self.stage(step, state, reuse=reuse, build_seconds=build_seconds)
        self.snapshots += 1
        return self.replicator.submit(step, slot)

    def stage(self, step: int, state: Mapping[str, Any], *, reuse: bool = False, build_seconds: float = 0.0) -> Slot:
        """Copy the state into a free own slot (not the agreed one, not the one the disk tier
        reads, not one the replicator reads) and mark it COMPLETE at ``step``; not replicated.
        One copy per tensor, straight from the live tensor into the slot's mapping."""
        assert self.layout is not None and self.replicator is not None
        t0 = time.perf_counter()
        slot = self._free_slot()
        if slot is None:  # the guard never stages with all three taken; say so rather than overwrite one
            raise MemoryTierError("no free memory slot: the agreed copy, the disk write and the replica copy "
                                  "hold all three")
        if not (reuse and self._plan is not None and self._plan[0] is state):
            self._plan = (state, *self._plan_of(state))
        _, sources, value_paths = self._plan
        views = slot.views(self.layout)
        t1 = time.perf_counter()
        slot.begin(step)
        copy_all(views, sources)
        t2 = time.perf_counter()
        values = {key: encode(get_path(state, path)) for key, path in value_paths}
        slot.finish(step, {"run": self.run, "world": self.world, "shard": self.rank, "role": OWN,
                           "layout": self.layout.hash, "values": values, "time": time.time()}, None)
        t3 = time.perf_counter()
        self.stalls.append(build_seconds + t3 - t0)
        self.stall_parts["build"].append(build_seconds)
        self.stall_parts["plan"].append(t1 - t0)
        self.stall_parts["copy"].append(t2 - t1)
        self.stall_parts["meta"].append(t3 - t2)
        return slot

    def free_slot(self) -> Slot | None:
        """An own slot :meth:`stage` may fill now (None: none is free, or the tier is not set up)."""
        return self._free_slot() if self.replicator is not None else None

    def _free_slot(self) -> Slot | None:
        """An own slot that is not the agreed copy, not the disk write's, not a replica round's."""
        assert self.replicator is not None
        in_use = self.replicator.slots_in_use()
        return next((s for s in self.own if s is not self.replicator.agreed_slot and s is not self.pinned
                     and all(s is not u for u in in_use)), None)

    def _plan_of(self, state: Mapping[str, Any]) -> tuple[list[torch.Tensor], list[tuple[str, tuple]]]:
        """The live tensors to copy (local shards, in leaf order) and the paths of the other leaves,
        checked against the layout fixed at the first snapshot."""
        assert self.layout is not None
        sources, value_paths = [], []
        leaves = self.layout.leaves
        for path, v in walk(state):
            if isinstance(v, torch.Tensor):
                t = local(v).detach()
                i = len(sources)
                if i >= len(leaves) or tuple(t.shape) != leaves[i].shape or t.dtype != leaves[i].dtype:
                    raise MemoryTierError("the state's tensors changed shape or number after the first memory "
                                          "snapshot; the memory tier needs a fixed layout")
                sources.append(t)
            else:
                value_paths.append((path_key(path), path))
        if len(sources) != len(leaves):
            raise MemoryTierError("the state's tensors changed shape or number after the first memory "
                                  "snapshot; the memory tier needs a fixed layout")
        return sources, value_paths

    def wait_idle(self) -> bool:
        return self.replicator is None or self.replicator.wait_idle(self.timeout)

    @property
    def agreed_step(self) -> int:
        return self.replicator.agreed_step if self.replicator is not None else -1

    def after_agreed(self) -> None:
        """Once a snapshot is agreed after a restore, drop copies this node no longer needs."""
        if not self._cleanup_after_first or self.agreed_step < 0:
            return
        self._cleanup_after_first = False
        keep = {s.path.name for s in self.own + self.replicas}
        local_ranks = [r for r in range(self.world) if self.holders and self.holders[r] == self.holder]
        if local_ranks and local_ranks[0] != self.rank:
            return  # one rank per node cleans
        for r in local_ranks:
            keep |= {slot_name(OWN, r, i) for i in range(OWN_SLOTS)}
            keep |= {slot_name(REPLICA, self.partners(r)[1], i) for i in range(REPLICA_SLOTS)}
        for name in os.listdir(self.dir):
            if parse_name(name) is not None and name not in keep:
                try:
                    os.unlink(self.dir / name)
                except OSError as exc:
                    log.warning("cannot remove the stale memory copy %s: %s", name, exc)

    def disk_state(self, slot: Slot, template: Mapping[str, Any]) -> Any:
        """The state of ``slot`` shaped like ``template`` (the live state dict), with DTensor
        wrappers around the slot's bytes where the live state has DTensors: what DCP saves,
        reshardable like a save of the live state, without another copy."""
        assert self.layout is not None
        key = id(slot)
        if key not in self._disk_cache:
            views = slot.views(self.layout)
            live = [v for _, v in walk(template) if isinstance(v, torch.Tensor)]
            wrapped = []
            for view, v in zip(views, live):
                if hasattr(v, "to_local"):
                    from torch.distributed.tensor import DTensor

                    wrapped.append(DTensor.from_local(view, v.device_mesh, v.placements, run_check=False,
                                                      shape=v.shape, stride=v.stride()))
                else:
                    wrapped.append(view)
            self._disk_cache[key] = wrapped
        _, _, _, meta = slot.header()
        return self.layout.rebuild(template, self._disk_cache[key], meta.get("values", {}))

    # -- restore ------------------------------------------------------------------------------------
    def restore(self, get_state, disk_step: int, read_disk: Callable[[Mapping[str, Any]], None] | None = None
                ) -> RestoreResult:
        """Collective. Find the newest step every shard of this run can be restored from memory
        (own node first, else the replica on a peer), load it into the live state and return what
        was done; ``tier == ""`` (with the reason) when memory has nothing as new as the newest
        disk snapshot ``disk_step`` (-1: none), or a copy failed to load on any rank — the caller
        then loads from disk. ``get_state()`` returns the live state dict (only called when
        memory will be used). ``read_disk(state)``, when given, reads this rank's part of the disk
        snapshot of ``disk_step`` into ``state`` without collectives: a shard whose every memory
        copy was lost (its node and the node holding its replica both failed) is then read from
        disk by its own rank alone while every other shard still comes from memory."""
        t0 = time.perf_counter()
        found, rejected = inventory(self.dir, run=self.run, world=self.world)
        for what, n in rejected.items():
            if n:
                log.warning("memory holder %s: %d %s cop%s ignored", self.dir, n, what.replace("_", " "),
                            "y" if n == 1 else "ies")
        everyone = self._gather((self.holder, found, rejected))
        self.holders = [e[0] for e in everyone]
        by_holder = {e[0]: e[1] for e in everyone}
        total_rejected: dict[str, int] = {}
        for h in dict.fromkeys(self.holders):
            for k, n in next(e[2] for e in everyone if e[0] == h).items():
                total_rejected[k] = total_rejected.get(k, 0) + n
        mixed_step = disk_step if read_disk is not None and disk_step >= 0 else None
        plan, why = plan_restore(self.world, self.holders, by_holder, disk_step=mixed_step)
        result = RestoreResult("", rejected=total_rejected)
        if plan is None or plan.step < disk_step:
            result.reason = why if plan is None else f"memory's newest complete step {plan.step} is older than disk's {disk_step}"
            return result
        state = get_state()
        layout = Layout.of(state)
        layouts = self._gather(layout.hash)
        plan, why = plan_restore(self.world, self.holders, by_holder, layouts, disk_step=mixed_step)
        if plan is None or plan.step < disk_step:
            result.reason = (why if plan is None else f"memory's newest complete step {plan.step} is older than disk's "
                             f"{disk_step}") + " (after matching layouts)"
            return result
        self.layout = layout
        self._plan = None  # the live tensors are about to be loaded into (or replaced)
        error = ""
        values: dict = {}
        try:
            values = self._execute(plan, layout, state, read_disk)
        except Exception as exc:  # noqa: BLE001 - any failure: every rank goes to disk together
            error = f"{type(exc).__name__}: {exc}"
            log.error("restore from memory at step %d failed on rank %d: %s", plan.step, self.rank, error)
        flag = torch.tensor([0 if error else 1], dtype=torch.int32)
        if collective(self.world):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not int(flag.item()):
            result.reason = error or "the restore from memory failed on another rank"
            return result
        self._cleanup_after_first = True
        result.tier, result.step, result.local, result.peer = "memory", plan.step, plan.local, plan.peer
        result.disk = plan.disk
        result.seconds = time.perf_counter() - t0
        return result

    def _execute(self, plan: RestorePlan, layout: Layout, state: Mapping[str, Any],
                 read_disk: Callable[[Mapping[str, Any]], None] | None = None) -> dict:
        """Read or receive this rank's shard, send the shards this rank's node holds for others."""
        works, keep = [], []
        for shard, sender in sorted(plan.senders.items()):
            if sender != self.rank:
                continue
            _, name, data_len, _ = plan.sources[shard]
            src = Slot(self.dir / name, data_len, create=False)
            keep.append(src)
            state_, step, _, meta = src.header()
            if state_ != COMPLETE or step != plan.step:
                raise MemoryTierError(f"{name} changed while being sent")
            raw = json.dumps(meta).encode()
            head = torch.tensor([len(raw)], dtype=torch.int64)
            keep += [head, torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
            works.append(dist.isend(head, dst=shard, group=self.group))
            works.append(dist.isend(keep[-1], dst=shard, group=self.group))
            for start in range(0, data_len, CHUNK):
                works.append(dist.isend(src.data[start:start + CHUNK], dst=shard, group=self.group))
        values: dict = {}
        try:
            _, name, data_len, crc = plan.sources[self.rank]
            sender = plan.senders[self.rank]
            if sender != DISK and data_len != layout.data_len:
                raise MemoryTierError(f"the memory copy {name} holds {data_len} bytes, this rank's state {layout.data_len}")
            if sender == DISK:
                if read_disk is None:
                    raise MemoryTierError(f"shard {self.rank} is to be read from disk, but no disk reader was given")
                read_disk(state)  # this rank's part of the disk snapshot of plan.step, while the sends above run
            elif sender is None:
                slot = Slot(self.dir / name, data_len, create=False)
                keep.append(slot)
                state_, step, crc, meta = slot.header()
                if state_ != COMPLETE or step != plan.step or meta.get("layout") != layout.hash:
                    raise MemoryTierError(f"{self.dir / name} is not the complete copy of step {plan.step} it was")
                if crc is not None and slot.crc() != crc:
                    raise MemoryTierError(f"{self.dir / name} is corrupt (CRC mismatch)")
                layout.restore_into(state, slot.views(layout), meta.get("values", {}))
            else:
                # received straight into an own slot: it is then this node's own copy of that step
                slot = self._open(OWN, self.rank, 0, layout.data_len)
                keep.append(slot)
                slot.begin(plan.step)
                head = torch.zeros(1, dtype=torch.int64)
                dist.recv(head, src=sender, group=self.group)
                raw = torch.zeros(int(head.item()), dtype=torch.uint8)
                dist.recv(raw, src=sender, group=self.group)
                for start in range(0, data_len, CHUNK):
                    dist.recv(slot.data[start:start + CHUNK], src=sender, group=self.group)
                meta = json.loads(raw.numpy().tobytes())
                if crc is not None and slot.crc() != crc:
                    raise MemoryTierError(f"shard {self.rank} received from rank {sender} is torn (CRC mismatch)")
                if meta.get("layout") != layout.hash or meta.get("run") != self.run:
                    raise MemoryTierError(f"shard {self.rank} received from rank {sender} is of another layout or run")
                meta["role"] = OWN
                slot.finish(plan.step, meta, crc)
                layout.restore_into(state, slot.views(layout), meta.get("values", {}))
                slot.close()
        finally:  # the sends complete whatever happened to this rank's own shard
            for w in works:
                w.wait()
            for s in keep:
                if isinstance(s, Slot):
                    s.close()
        return values

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.wait_idle(self.timeout)
            self.replicator.close()
        self._disk_cache.clear()
        self._plan = None
        for s in self.own + self.replicas:
            s.close()
