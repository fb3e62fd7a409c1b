"""The topology model: each node's :class:`Place`, the readings sources give, and :func:`merge`,
which combines them and raises :class:`TopologyConflict` on a contradiction (see the package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

TIER_NAMES = ("leaf", "spine", "core")


class TopologyError(ValueError):
    """Topology input that cannot be read (the message names the source and the line or key)."""


class TopologyConflict(TopologyError):
    """Two readings contradict each other; the message names both sources and the node."""


def tier_name(i: int) -> str:
    return TIER_NAMES[i] if i < len(TIER_NAMES) else f"tier-{i}"


@dataclass(frozen=True)
class Place:
    """Where one node sits. ``None`` (or a ``None`` tier in ``switches``) is "not known"."""

    nvlink: str | None = None
    nvlink_sub: str | None = None
    switches: tuple[str | None, ...] = ()  # nearest first: leaf, spine, ...
    rack: str | None = None
    power: str | None = None

    def switch(self, tier: int) -> str | None:
        return self.switches[tier] if tier < len(self.switches) else None

    @property
    def leaf(self) -> str | None:
        return self.switch(0)

    @property
    def known(self) -> bool:
        return bool(self.nvlink or self.rack or self.power or any(self.switches))


@dataclass(frozen=True)
class Reading:
    """What one source says about one node. Every field is optional. Sources in the same
    ``namespace`` name domains alike (a Slurm switch and a file's switch; Topograph's domain and
    the GPU operator's clique), so a different value for one node is a contradiction; across
    namespaces (AWS's ultraserver id vs Topograph's domain) only the grouping must agree."""

    node: str
    source: str
    place: Place
    namespace: str = ""


# -- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Topology:
    """Node -> :class:`Place`, plus which source said what (for error messages and ``describe``)."""

    places: Mapping[str, Place] = field(default_factory=dict)
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # node -> the sources that placed it

    def place(self, node: str) -> Place:
        return self.places.get(node, Place())

    @property
    def empty(self) -> bool:
        return not any(p.known for p in self.places.values())

    def members(self, level: str, node: str) -> frozenset[str]:
        """The nodes that share ``node``'s domain at ``level`` ("nvlink", "rack", "power", or a
        tier name); empty when ``node``'s domain at that level is unknown."""
        key = _level_key(level)
        mine = key(self.place(node))
        if mine is None:
            return frozenset()
        return frozenset(n for n, p in self.places.items() if key(p) == mine)

    def groups(self, level: str) -> frozenset[frozenset[str]]:
        """The partition of the placed nodes at ``level`` (nodes without a value left out): two
        models describe the same cluster when their groups agree at every level."""
        key = _level_key(level)
        out: dict[str, set[str]] = {}
        for n, p in self.places.items():
            v = key(p)
            if v is not None:
                out.setdefault(v, set()).add(n)
        return frozenset(frozenset(s) for s in out.values())

    def levels(self) -> list[str]:
        depth = max((len(p.switches) for p in self.places.values()), default=0)
        return ["nvlink", *(tier_name(i) for i in range(depth)), "rack", "power"]

    def describe(self) -> list[str]:
        """One line per node (``sentinel topology show``)."""
        out = []
        for n in sorted(self.places, key=_natural):
            p = self.places[n]
            path = " > ".join(s or "?" for s in p.switches) or "?"
            out.append(f"{n}: nvlink={p.nvlink or '?'} switches={path} rack={p.rack or '?'} power={p.power or '?'} "
                       f"(from {', '.join(self.sources.get(n, ())) or 'nothing'})")
        return out


def _level_key(level: str):
    if level == "nvlink":
        return lambda p: p.nvlink
    if level in ("rack", "power"):
        return lambda p: getattr(p, level)
    if level in TIER_NAMES:
        tier = TIER_NAMES.index(level)
    elif level.startswith("tier-") and level[5:].isdigit():
        tier = int(level[5:])
    else:
        raise ValueError(f"unknown topology level {level!r}")
    # a switch name is the same switch wherever it appears, so the switch alone names the domain
    return lambda p: p.switch(tier)


def merge(readings: Iterable[Reading]) -> Topology:
    """One model from every source's readings. A field one source leaves unknown is filled by
    another; two sources giving different values, or inducing different groupings (two nodes in
    one NVLink domain for one source, in two for the other), raise :class:`TopologyConflict`."""
    readings = list(readings)
    _check_partitions(readings)
    places: dict[str, Place] = {}
    said: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}  # (node, namespace) -> field -> (value, source)
    sources: dict[str, list[str]] = {}
    for r in readings:
        cur = places.get(r.node, Place())
        mine = said.setdefault((r.node, r.namespace), {})
        fields = {"nvlink": r.place.nvlink, "nvlink_sub": r.place.nvlink_sub, "rack": r.place.rack, "power": r.place.power}
        fields.update({f"switch{i}": s for i, s in enumerate(r.place.switches)})
        for name, value in fields.items():
            if value is None:
                continue
            if name in mine and mine[name][0] != value:
                raise TopologyConflict(f"node {r.node}: {mine[name][1]} says {_field_label(name)} {mine[name][0]!r}, "
                                       f"{r.source} says {value!r}")
            mine.setdefault(name, (value, r.source))
        switches = list(cur.switches) + [None] * max(0, len(r.place.switches) - len(cur.switches))
        for i, s in enumerate(r.place.switches):
            if s is not None:
                switches[i] = s
        cur = Place(nvlink=cur.nvlink or r.place.nvlink, nvlink_sub=cur.nvlink_sub or r.place.nvlink_sub,
                    switches=tuple(switches), rack=cur.rack or r.place.rack, power=cur.power or r.place.power)
        places[r.node] = cur
        if r.place.known and r.source not in sources.setdefault(r.node, []):
            sources[r.node].append(r.source)
        sources.setdefault(r.node, [])
    topo = Topology(places, {n: tuple(s) for n, s in sources.items()})
    _check_tree(topo)
    return topo


def _field_label(name: str) -> str:
    if name.startswith("switch"):
        return f"the {tier_name(int(name[6:]))} switch"
    return {"nvlink": "NVLink domain", "nvlink_sub": "NVLink sub-domain", "rack": "rack", "power": "power domain"}[name]


def _check_partitions(readings: list[Reading]) -> None:
    """Per level, every source must group the nodes it places the same way as every other source
    (values may be named differently: AWS's ultraserver id and Topograph's domain)."""
    by_source: dict[str, list[Reading]] = {}
    for r in readings:
        by_source.setdefault(r.source, []).append(r)
    names = sorted(by_source)
    levels = {"nvlink": lambda p: p.nvlink, "rack": lambda p: p.rack, "power": lambda p: p.power}
    depth = max((len(r.place.switches) for r in readings), default=0)
    for i in range(depth):
        levels[tier_name(i)] = (lambda t: lambda p: p.switch(t))(i)
    for level, key in levels.items():
        for ai, a in enumerate(names):
            va = {r.node: key(r.place) for r in by_source[a] if key(r.place) is not None}
            for b in names[ai + 1:]:
                vb = {r.node: key(r.place) for r in by_source[b] if key(r.place) is not None}
                common = sorted(set(va) & set(vb), key=_natural)
                fwd: dict[str, tuple[str, str]] = {}
                back: dict[str, tuple[str, str]] = {}
                for n in common:
                    x, y = va[n], vb[n]
                    if x in fwd and fwd[x][0] != y:
                        m = fwd[x][1]
                        raise TopologyConflict(
                            f"node {n}: {a} puts it in the same {level} domain as {m} ({x!r}), {b} does not "
                            f"({m} in {fwd[x][0]!r}, {n} in {y!r})")
                    if y in back and back[y][0] != x:
                        m = back[y][1]
                        raise TopologyConflict(
                            f"node {n}: {b} puts it in the same {level} domain as {m} ({y!r}), {a} does not "
                            f"({m} in {back[y][0]!r}, {n} in {x!r})")
                    fwd.setdefault(x, (y, n))
                    back.setdefault(y, (x, n))


def _check_tree(topo: Topology) -> None:
    """A switch has one parent: a leaf under spine s1 for one node and s2 for another is a
    contradiction (a tree cannot have both)."""
    parent: dict[str, tuple[str, str]] = {}
    for n in sorted(topo.places, key=_natural):
        path = topo.places[n].switches
        for i in range(len(path) - 1):
            s, up = path[i], path[i + 1]
            if s is None or up is None:
                continue
            if s in parent and parent[s][0] != up:
                other = parent[s][1]
                raise TopologyConflict(
                    f"node {n}: its {tier_name(i)} switch {s!r} sits under {up!r} "
                    f"({', '.join(topo.sources.get(n, ())) or '?'}), but under {parent[s][0]!r} for node {other} "
                    f"({', '.join(topo.sources.get(other, ())) or '?'})")
            parent.setdefault(s, (up, n))



def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


natural = _natural  # the sort key for node names: node2 before node10
