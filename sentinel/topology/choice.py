"""The decisions the topology drives: the nearest spare, the memory tier's replica placement and
the per-domain circuit breaker. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from sentinel.topology.model import Topology, _level_key, _natural, tier_name

# -- distance and the nearest spare -------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Distance:
    """How far apart two nodes are: ``rank`` orders (0 = same NVLink sub-domain ... far, unknown);
    ``name`` is what the timeline and the metric show; ``via`` is the shared domain's id."""

    rank: int
    name: str = field(compare=False)
    via: str = field(default="", compare=False)


UNKNOWN_RANK = 1000
FAR_RANK = 999


def distance(topo: Topology, a: str, b: str) -> Distance:
    """nvlink-sub < nvlink < leaf < spine < tier-N < far (both placed, nothing shared) < unknown."""
    pa, pb = topo.place(a), topo.place(b)
    if pa.nvlink and pa.nvlink == pb.nvlink:
        if pa.nvlink_sub and pa.nvlink_sub == pb.nvlink_sub:
            return Distance(0, "nvlink-sub", f"{pa.nvlink}/{pa.nvlink_sub}")
        return Distance(1, "nvlink", pa.nvlink)
    depth = max(len(pa.switches), len(pb.switches))
    for i in range(depth):
        s = pa.switch(i)
        if s is not None and s == pb.switch(i):
            return Distance(2 + i, tier_name(i), s)
    if any(pa.switches) and any(pb.switches):
        return Distance(FAR_RANK, "far", "")
    return Distance(UNKNOWN_RANK, "unknown", "")


@dataclass(frozen=True)
class SpareChoice:
    node: str
    distance: str  # Distance.name
    rank: int
    why: str

    def as_dict(self) -> dict:
        return {"node": self.node, "distance": self.distance, "rank": self.rank, "why": self.why}


def choose_spare(topo: Topology, departed: str, candidates: Sequence[str]) -> SpareChoice | None:
    """The waiting spare nearest ``departed`` (same NVLink domain, else same leaf, else same
    spine, ... else any); ties, and a topology that knows nothing, keep ``candidates``' order
    (today's choice: the first waiting spare). None when there is no candidate."""
    candidates = [c for c in candidates if c != departed]
    if not candidates:
        return None
    scored = sorted(((distance(topo, departed, c), i, c) for i, c in enumerate(candidates)), key=lambda t: (t[0].rank, t[1]))
    d, _, node = scored[0]
    if d.rank == UNKNOWN_RANK:
        why = (f"topology unknown for {departed}" if not topo.place(departed).known else "topology unknown for every spare") \
            + f": first waiting spare {node}"
    elif d.rank == FAR_RANK:
        why = f"no waiting spare shares an NVLink domain or switch with {departed}: first waiting spare {node}"
    else:
        what = {"nvlink-sub": "NVLink sub-domain", "nvlink": "NVLink domain"}.get(d.name, f"{d.name} switch")
        why = f"{node} shares the {what} {d.via} with {departed}"
        if d.rank > 1 and topo.place(departed).nvlink:
            why += f" (no waiting spare in its NVLink domain {topo.place(departed).nvlink})"
    others = [f"{c} ({dd.name})" for dd, _, c in scored[1:4]]
    if others:
        why += "; also waiting: " + ", ".join(others)
    return SpareChoice(node, d.name, d.rank, why)


# -- the memory tier's replica placement ----------------------------------------------------------------
def failure_domain(topo: Topology, node: str) -> str:
    """What one accident takes down with ``node``: its rack (and power feed), else its NVLink
    domain (an NVL72 is one rack), else the node alone."""
    p = topo.place(node)
    if p.rack or p.power:
        return f"rack={p.rack or '?'},power={p.power or '?'}"
    if p.nvlink:
        return f"nvlink={p.nvlink}"
    return f"node={node}"


def _shares_failure(topo: Topology, a: str, b: str) -> bool:
    pa, pb = topo.place(a), topo.place(b)
    if (pa.rack and pa.rack == pb.rack) or (pa.power and pa.power == pb.power):
        return True
    if not (pa.rack or pa.power or pb.rack or pb.power):
        return bool(pa.nvlink) and pa.nvlink == pb.nvlink
    return False


@dataclass(frozen=True)
class ReplicaPlan:
    """``holder[i]``: the index of the node that keeps node ``i``'s replica (a permutation with no
    fixed point: every node keeps exactly one other node's replica). ``shared`` lists the
    nodes whose replica had to stay in their own failure domain (no other domain had room)."""

    nodes: tuple[str, ...]
    holder: tuple[int, ...]
    shared: tuple[str, ...] = ()
    topology_used: bool = True

    @property
    def source(self) -> tuple[int, ...]:
        """``source[i]``: the node whose replica node ``i`` keeps."""
        out = [0] * len(self.holder)
        for i, h in enumerate(self.holder):
            out[h] = i
        return tuple(out)

    def lines(self, topo: Topology) -> list[str]:
        out = []
        for i, h in enumerate(self.holder):
            d = distance(topo, self.nodes[i], self.nodes[h])
            out.append(f"{self.nodes[i]} ({failure_domain(topo, self.nodes[i])}) -> replica on {self.nodes[h]} "
                       f"({failure_domain(topo, self.nodes[h])}, {d.name})")
        return out


def replica_plan(topo: Topology, nodes: Sequence[str]) -> ReplicaPlan:
    """Each node's replica goes to a node in another failure domain (rack/power), as close in the
    network as that allows (same leaf where possible, else same spine, ...). Deterministic in
    ``nodes`` and ``topo`` alone, so every rank computes the same plan. With no usable topology:
    the ring ``(n + 1) mod N``, as before."""
    nodes = tuple(nodes)
    n = len(nodes)
    if n < 2:
        return ReplicaPlan(nodes, tuple(range(n)), (), False)
    if not any(topo.place(x).known for x in nodes):
        return ReplicaPlan(nodes, tuple((i + 1) % n for i in range(n)), (), False)
    index = {x: i for i, x in enumerate(nodes)}
    depth = max(len(topo.place(x).switches) for x in nodes)
    remaining = list(nodes)
    rings: list[list[str]] = []
    for tier in range(depth + 1):  # the last pass groups everything left together
        groups: dict[str, list[str]] = {}
        for x in remaining:
            key = topo.place(x).switch(tier) if tier < depth else "*"
            groups.setdefault(key or f"?{x}" if tier < depth else "*", []).append(x)
        remaining = []
        for key, members in sorted(groups.items()):
            ring = _ring(topo, members)
            if ring is not None and len(members) > 1:
                rings.append(ring)
            elif tier == depth:
                # what is left cannot leave its rack on its own: take back the nodes of closer
                # rings, the ones richest in other failure domains first, until it can
                while ring is None and rings:
                    crowded = max(_domain_sizes(topo, members).items(), key=lambda kv: (kv[1], kv[0]))[0]
                    best = max(range(len(rings)), key=lambda k: (
                        sum(failure_domain(topo, x) != crowded for x in rings[k]), -k))
                    members = members + rings.pop(best)
                    ring = _ring(topo, members)
                rings.append(ring or _ring(topo, members, force=True) or members)
            else:
                remaining.extend(members)
        if not remaining:
            break
    holder = [0] * n
    shared = []
    for ring in rings:
        for k, x in enumerate(ring):
            y = ring[(k + 1) % len(ring)]
            holder[index[x]] = index[y]
            if _shares_failure(topo, x, y) or x == y:
                shared.append(x)
    return ReplicaPlan(nodes, tuple(holder), tuple(sorted(shared, key=index.get)), True)


def _domain_sizes(topo: Topology, members: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in members:
        out[failure_domain(topo, x)] = out.get(failure_domain(topo, x), 0) + 1
    return out


def _ring(topo: Topology, members: list[str], force: bool = False) -> list[str] | None:
    """An order of ``members`` as a cycle in which neighbours are in different failure domains:
    fill the even slots, then the odd ones, biggest domain first. None when impossible (one
    domain holds more than half) unless ``force``."""
    if len(members) < 2:
        return list(members) if force else None
    domains: dict[str, list[str]] = {}
    for x in sorted(members, key=_natural):
        domains.setdefault(failure_domain(topo, x), []).append(x)
    ordered = [x for _, xs in sorted(domains.items(), key=lambda kv: (-len(kv[1]), kv[0])) for x in xs]
    m = len(ordered)
    slots = list(range(0, m, 2)) + list(range(1, m, 2))
    ring = [""] * m
    for x, s in zip(ordered, slots):
        ring[s] = x
    ok = all(not _shares_failure(topo, ring[k], ring[(k + 1) % m]) for k in range(m))
    return ring if ok or force else None


# -- the per-domain circuit breaker ---------------------------------------------------------------------
@dataclass(frozen=True)
class DomainVerdict:
    allowed: bool
    why: str
    level: str = ""
    domain: str = ""


def domain_breaker(topo: Topology, node: str, cordons: Iterable[tuple[str, float]], now: float, *,
                   window_seconds: float, max_fraction: Mapping[str, float]) -> DomainVerdict:
    """Refuse to drain ``node`` when, counting it, more than ``max_fraction[level]`` of the nodes
    of its domain at ``level`` ("nvlink", "leaf", ...) would be under a Sentinel cordon made in the
    last ``window_seconds``: trouble across a whole domain is a switch or power problem — page,
    do not drain. A domain of one node, or one the topology does not know, is not limited here
    (the fleet-wide breaker still is)."""
    # a stamp ahead of this clock counts (as sentinel.backends.breaker.in_window): a clock skew must not open it
    recent = {n for n, t in cordons if n != node and t >= now - window_seconds}
    notes = []
    for level, limit in max_fraction.items():
        members = topo.members(level, node)
        if len(members) < 2:
            continue
        drained = len(recent & members) + 1
        share = drained / len(members)
        domain = _level_key(level)(topo.place(node)) or ""
        if drained > domain_slots(len(members), limit):
            return DomainVerdict(False, f"{drained} of the {len(members)} nodes of {level} domain {domain} would be drained "
                                        f"by Sentinel within {window_seconds:g} s ({share:.0%} > {limit:.0%}): a whole-domain "
                                        f"problem (switch, power) — page, do not drain", level, domain)
        notes.append(f"{level} {domain}: {drained}/{len(members)} <= {limit:.0%}")
    return DomainVerdict(True, "; ".join(notes) or "no multi-node domain known for this node")


def domain_slots(size: int, max_fraction: float) -> int:
    """How many of a domain's ``size`` nodes may be under a recent Sentinel cordon at once."""
    return int(math.floor(max_fraction * size + 1e-9))


def domain_settle(topo: Topology, node: str, cordons: Iterable[tuple[str, float]], now: float, *,
                  window_seconds: float, max_fraction: Mapping[str, float]) -> tuple[str, DomainVerdict]:
    """The per-domain breaker for drain-then-recount (as :func:`sentinel.backends.breaker.settle`
    for the fleet): called after this node's own Sentinel cordon is in place, on a fresh count.
    ``"won"`` when, in every limited domain of ``node``, the recent Sentinel cordons (this one
    included) fit in :func:`domain_slots`; ``"lost"`` when this node ranks past the slots of some
    domain in the deterministic order (cordon time, then name: every node computes the same
    order) and must undo its cordon; ``"wait"`` when it ranks within them but nodes ranked after
    it have not undone theirs yet. A burst of trips inside one NVLink domain thus never keeps
    more than the share, as the fleet breaker's argument shows."""
    cordons = list(cordons)
    outcome, verdict = "won", None
    notes = []
    for level, limit in max_fraction.items():
        members = topo.members(level, node)
        if len(members) < 2:
            continue
        recent = {n: t for n, t in cordons if n in members and t >= now - window_seconds}
        recent.setdefault(node, now)
        slots = domain_slots(len(members), limit)
        domain = _level_key(level)(topo.place(node)) or ""
        if len(recent) <= slots:
            notes.append(f"{level} {domain}: {len(recent)}/{len(members)} <= {limit:.0%}")
            continue
        why = (f"{len(recent)} of the {len(members)} nodes of {level} domain {domain} would be drained by Sentinel "
               f"within {window_seconds:g} s ({len(recent) / len(members):.0%} > {limit:.0%}): a whole-domain problem "
               f"(switch, power) — page, do not drain")
        order = sorted(recent, key=lambda n: (recent[n], _natural(n)))
        mine = "lost" if order.index(node) >= slots else "wait"
        if verdict is None or (mine == "lost" and outcome != "lost"):
            outcome, verdict = mine, DomainVerdict(False, why, level, domain)
    if verdict is not None:
        return outcome, verdict
    return "won", DomainVerdict(True, "; ".join(notes) or "no multi-node domain known for this node")
