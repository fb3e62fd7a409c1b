"""Restore planning, pure: which copy of each shard a restore reads, at the newest step every
shard has. No torch and no I/O: it decides from the holders' inventories and the ranks' layouts.

Placement: rank ``r`` on node ``n`` (``n = r // L``, ``L`` ranks per node, torchrun's order)
sends its shard to the rank with the same local rank on node ``(n + 1) mod N`` and holds the shard
of the same local rank on node ``(n - 1) mod N`` (:func:`ring_partners`) — or, with a topology
(``SENTINEL_TOPOLOGY``), on the node :func:`sentinel.topology.replica_plan` picks: another rack
or power domain, as near in the network as that allows (:func:`placed_partners`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from trainer.memory.slot import OWN, SlotInfo


DISK = -1  # RestorePlan.senders: the shard's own rank reads it from the disk snapshot of the same step


@dataclass
class RestorePlan:
    """Which copy each shard is restored from, at one step every shard has."""

    step: int
    # shard -> (holder id, file, data_len, crc): the copy chosen ("" holder: the disk snapshot)
    sources: dict[int, tuple[str, str, int, int | None]]
    # shard -> the rank that sends it (None: the shard's own rank reads it from its node's memory;
    # DISK: the shard's own rank reads its part of the disk snapshot of this step, alone)
    senders: dict[int, int | None]
    local: list[int] = field(default_factory=list)
    peer: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)


def plan_restore(world: int, holders: list[str], found: Mapping[str, list[SlotInfo]],
                 layouts: list[str] | None = None, disk_step: int | None = None) -> tuple[RestorePlan | None, str]:
    """The newest step every shard ``0..world-1`` can be restored from, and from where.

    ``holders[r]`` is the holder id of rank ``r``'s node now; ``found[h]`` the loadable slots in
    holder ``h``; ``layouts[r]`` rank ``r``'s layout hash (a copy of another layout is unusable).
    A shard's copy in its own rank's holder is preferred; otherwise the lowest rank on the holder
    with a copy sends it. ``disk_step``: the step of the newest complete disk snapshot, if its
    shards can be read one rank at a time: at that step a shard whose every memory copy was lost
    (two adjacent nodes failed together) is read from disk by its own rank while the others come
    from memory — unless no shard at all would come from memory. Returns (None, why) when no step
    has every shard."""
    by_step: dict[int, dict[int, list[tuple[str, SlotInfo]]]] = {}
    for h, infos in found.items():
        for info in infos:
            if layouts is not None and info.meta.get("layout") != layouts[info.shard]:
                continue
            by_step.setdefault(info.step, {}).setdefault(info.shard, []).append((h, info))
    if not by_step:
        return None, "no memory snapshot of this run"
    in_job = set(holders)
    missing_newest = ""
    for step in sorted(by_step, reverse=True):
        copies = {r: [hc for hc in c if hc[0] in in_job] for r, c in by_step[step].items()}
        missing = [r for r in range(world) if not copies.get(r)]
        mixed = step == disk_step and len(missing) < world
        if missing and not mixed:
            if not missing_newest:
                lost = [r for r in missing if r not in by_step[step]]
                missing_newest = (f"no copy of shard(s) {lost[:8]} at step {step} (own and replica both lost)" if lost
                                  else f"the copies of shard(s) {missing[:8]} at step {step} are on nodes that left the job")
            continue
        plan = RestorePlan(step, {}, {})
        for r in range(world):
            if r in missing:
                plan.sources[r], plan.senders[r] = ("", "", 0, None), DISK
                plan.disk.append(r)
                continue
            options = sorted(copies[r], key=lambda hc: (hc[0] != holders[r], hc[1].role != OWN, hc[0], hc[1].file))
            h, info = options[0]
            plan.sources[r] = (h, info.file, info.data_len, info.crc)
            if h == holders[r]:
                plan.senders[r] = None
                plan.local.append(r)
            else:
                on_h = [q for q in range(world) if holders[q] == h]
                plan.senders[r] = on_h[r % len(on_h)]
                plan.peer.append(r)
        return plan, ""
    return None, missing_newest  # every step was skipped, the first one saying why


def ring_partners(rank: int, world: int, local_world: int) -> tuple[int, int]:
    """(send to, receive from): same local rank on the next / previous node."""
    nodes = max(1, world // local_world)
    node, local = divmod(rank, local_world)
    return ((node + 1) % nodes) * local_world + local, ((node - 1) % nodes) * local_world + local



def nodes_left_without_a_copy(holder_of_node: Sequence[int], leaving: set[int]) -> list[int]:
    """The leaving nodes whose replica holder leaves too (node ``n``'s replicas live on node
    ``holder_of_node[n]``): their shards would have no copy in memory once the nodes are gone,
    so a migration must not let them go before the disk copy is written."""
    if len(holder_of_node) < 2:
        return sorted(leaving)  # one node: its memory is the only copy
    return sorted(n for n in leaving if holder_of_node[n] in leaving)


def placed_partners(rank: int, world: int, local_world: int, holder_of_node: Sequence[int]) -> tuple[int, int]:
    """(send to, receive from) when node ``n``'s replicas live on node ``holder_of_node[n]`` (a
    permutation without fixed points, :class:`sentinel.topology.ReplicaPlan`): same local rank."""
    node, local = divmod(rank, local_world)
    source = holder_of_node.index(node) if len(holder_of_node) > 1 else node
    return holder_of_node[node] * local_world + local, source * local_world + local
