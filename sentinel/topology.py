"""The cluster's topology: for each node its NVLink domain, its switch path (leaf first, then
spine, then the tiers above) and its failure domains (rack, power feed); and the three decisions
that use it — the nearest spare, the peer that holds a node's memory-tier replica, and the
per-domain circuit breaker. Pure: no I/O except the explicit ``read_*`` helpers, no clock.

Sources (each yields :class:`Reading` s; :func:`merge` combines them):

* Slurm ``topology.conf`` / ``scontrol show topology`` — ``topology/tree``
  (``SwitchName=s Nodes=… Switches=…``: a switch listing nodes is a leaf, its parents are found
  through ``Switches=``) and ``topology/block`` (``BlockName=b Nodes=…``: a block is an NVLink
  domain; with ``BlockSizes=18,36,72`` consecutive blocks aggregate into larger groups, which rank
  as the leaf and spine levels). :func:`parse_slurm_topology`.
* Kubernetes node labels — Topograph's ``accelerator.topograph.run/domain`` (NVLink domain),
  ``accelerator.topograph.run/sub-domain``, ``fabric.topograph.run/tier-N`` (tier 0 is the switch
  nearest the node); Topograph's older ``network.topology.nvidia.com/{accelerator,block,spine,datacenter}``;
  the GPU operator's ``nvidia.com/gpu.clique`` (``<cluster uuid>.<clique id>``); GCP's
  ``cloud.google.com/gce-topology-{subblock,block}`` (subblock = leaf, block = spine); AWS's
  ``topology.k8s.aws/network-node-layer-1..4`` (layer 1 is the farthest: the highest layer present
  is the leaf) and ``topology.k8s.aws/ultraserver-id`` (NVLink domain); and Sentinel's own
  ``sentinel.dev/rack``, ``sentinel.dev/power``. :func:`from_labels`.
* NVML's fabric info on the node (cluster UUID + clique id of each GPU): :func:`from_nvml_fabric`.
* A plain file (TOML, or JSON when it ends in ``.json``)::

      [nodes.node1]
      nvlink = "nvl72-a"           # NVLink domain
      switches = ["leaf-a", "spine-1"]   # nearest first
      rack = "rack-3"
      power = "pdu-3a"

  :func:`parse_file`.

Unknown or partial topology is a reading, not an error: a node no source places has an empty
:class:`Place`, and every choice then falls back to today's order (the first waiting spare; the
next node in rank order). Contradictory topology is an error (:class:`TopologyConflict`) whose
message names the sources and the node: a node under two leaf switches, a switch with two
parents, a cycle, a leaf that sits under one spine for one node and another for the next, two
sources (or two label conventions on one node) that disagree about which nodes share a domain.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

#: The names of the switch tiers, nearest first; above these, ``tier-N``.
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


# -- Slurm ------------------------------------------------------------------------------------------
def expand_hostlist(expr: str) -> list[str]:
    """Slurm's hostlist expression: ``node[1-3,7],gpu[01-02]-a`` -> the names, in order."""
    out: list[str] = []
    for item in _split_top(expr.strip()):
        if item:
            out.extend(_expand_one(item))
    return out


def _split_top(expr: str) -> list[str]:
    items, depth, cur = [], 0, []
    for c in expr:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise TopologyError(f"unbalanced ']' in hostlist {expr!r}")
        if c == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if depth:
        raise TopologyError(f"unbalanced '[' in hostlist {expr!r}")
    items.append("".join(cur))
    return items


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise TopologyError(f"bad range {part!r} in hostlist {item!r}")
        width = len(lo) if lo.startswith("0") else 0
        for i in range(int(lo), int(hi if dash else lo) + 1):
            out.extend(_expand_one(f"{head}{i:0{width}d}{tail}"))
    return out


def _slurm_fields(line: str) -> dict[str, str]:
    out = {}
    for item in line.split():
        key, eq, value = item.partition("=")
        if eq:
            out[key.lower()] = value
    return out


def parse_slurm_topology(text: str, source: str = "topology.conf") -> list[Reading]:
    """Readings from ``topology.conf`` (or ``scontrol show topology``) text, tree or block."""
    switches: dict[str, dict] = {}
    blocks: list[tuple[str, list[str], int]] = []
    block_sizes: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        f = _slurm_fields(line)
        where = f"{source} line {lineno}"
        if "switchname" in f:
            name = f["switchname"]
            if name in switches:
                raise TopologyConflict(f"{where}: switch {name!r} is defined twice (first on line {switches[name]['line']})")
            children = expand_hostlist(f["switches"]) if f.get("switches", "(null)") not in ("", "(null)") else []
            # a switch has nodes or switches below it; `scontrol show topology` also lists, under
            # every upper switch, all the nodes beneath it: only a leaf's Nodes= place a node
            nodes = expand_hostlist(f["nodes"]) if f.get("nodes", "(null)") not in ("", "(null)") and not children else []
            switches[name] = {"nodes": nodes, "children": children, "line": lineno}
        elif "blockname" in f:
            nodes = expand_hostlist(f["nodes"]) if f.get("nodes", "(null)") not in ("", "(null)") else []
            blocks.append((f["blockname"], nodes, lineno))
        elif "blocksizes" in f:
            try:
                block_sizes = [int(x) for x in f["blocksizes"].split(",")]
            except ValueError:
                raise TopologyError(f"{where}: BlockSizes must be a comma-separated list of integers "
                                    f"(got {f['blocksizes']!r})") from None
        elif {"blockindex", "blocksize"} & set(f) or "level" in f or "linkspeed" in f:
            continue  # scontrol show topology extras without a name: nothing to read
        else:
            raise TopologyError(f"{where}: expected SwitchName=, BlockName= or BlockSizes= (got {line[:80]!r})")
    readings: list[Reading] = []
    if switches:
        readings += _tree_readings(switches, source)
    if blocks:
        readings += _block_readings(blocks, block_sizes, source)
    return readings


def _tree_readings(switches: dict[str, dict], source: str) -> list[Reading]:
    parent: dict[str, str] = {}
    for name, s in switches.items():
        for child in s["children"]:
            if child not in switches:
                raise TopologyError(f"{source} line {s['line']}: switch {name!r} lists {child!r} under Switches=, "
                                    f"which is not defined")
            if child in parent:
                raise TopologyConflict(f"{source}: switch {child!r} sits under both {parent[child]!r} and {name!r}")
            parent[child] = name
    leaf_of: dict[str, str] = {}
    for name, s in switches.items():
        for node in s["nodes"]:
            if node in leaf_of:
                raise TopologyConflict(f"{source}: node {node} is under two leaf switches, {leaf_of[node]!r} "
                                       f"(line {switches[leaf_of[node]]['line']}) and {name!r} (line {s['line']})")
            leaf_of[node] = name
    out = []
    for node, leaf in leaf_of.items():
        path, seen = [leaf], {leaf}
        while path[-1] in parent:
            up = parent[path[-1]]
            if up in seen:
                raise TopologyConflict(f"{source}: switches {' > '.join(path + [up])} form a cycle (node {node})")
            seen.add(up)
            path.append(up)
        out.append(Reading(node, f"{source} (topology/tree)", Place(switches=tuple(path))))
    return out


def _block_readings(blocks: list[tuple[str, list[str], int]], sizes: list[int], source: str) -> list[Reading]:
    """A block is an NVLink domain. With BlockSizes, groups of 2^k consecutive blocks (as the
    sizes allow) are the levels above it: they rank as leaf, spine, ... in the distance."""
    seen: dict[str, str] = {}
    for name, nodes, line in blocks:
        for n in nodes:
            if n in seen:
                raise TopologyConflict(f"{source}: node {n} is in two blocks, {seen[n]!r} and {name!r} (line {line})")
            seen[n] = name
    base = sizes[0] if sizes else 0
    factors = [s // base for s in sizes[1:] if base and s % base == 0 and s > base] if sizes else []
    out = []
    for index, (name, nodes, _line) in enumerate(blocks):
        groups = []
        for f in factors:
            first = (index // f) * f
            last = min(first + f, len(blocks)) - 1
            groups.append(f"{blocks[first][0]}..{blocks[last][0]}")
        for n in nodes:
            out.append(Reading(n, f"{source} (topology/block)", Place(nvlink=name, switches=tuple(groups))))
    return out


# -- Kubernetes labels --------------------------------------------------------------------------------
#: (label, what it gives) per convention; a convention is one source for the conflict check.
LABEL_CONVENTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "topograph": (("accelerator.topograph.run/domain", "nvlink"), ("accelerator.topograph.run/sub-domain", "nvlink_sub")),
    "topograph-legacy": (("network.topology.nvidia.com/accelerator", "nvlink"), ("network.topology.nvidia.com/block", "tier0"),
                         ("network.topology.nvidia.com/spine", "tier1"), ("network.topology.nvidia.com/datacenter", "tier2")),
    "gpu-operator": (("nvidia.com/gpu.clique", "nvlink"),),
    "gcp": (("cloud.google.com/gce-topology-subblock", "tier0"), ("cloud.google.com/gce-topology-block", "tier1")),
    "aws": (("topology.k8s.aws/ultraserver-id", "nvlink"),),  # the network layers: below
    "sentinel": (("sentinel.dev/rack", "rack"), ("sentinel.dev/power", "power"), ("sentinel.dev/nvlink-domain", "nvlink")),
}
#: conventions whose values name the same things alike (Topograph's domain is the GPU operator's
#: clique, ``<cluster uuid>.<clique id>``, as NVML gives it); Sentinel's own labels share the
#: files' and Slurm's namespace ("")
LABEL_NAMESPACES = {"topograph": "nvidia", "topograph-legacy": "nvidia", "gpu-operator": "nvidia", "gcp": "gcp",
                    "aws": "aws", "sentinel": ""}
_TOPOGRAPH_TIER = re.compile(r"^fabric\.topograph\.run/tier-(\d+)$")
_AWS_LAYER = re.compile(r"^topology\.k8s\.aws/network-node-layer-(\d+)$")


def from_labels(node: str, labels: Mapping[str, str], source: str = "kubernetes") -> list[Reading]:
    """One reading per label convention present on the Node (each convention is its own source,
    so Topograph's and the cloud's labels are checked against each other)."""
    out = []
    for convention, keys in LABEL_CONVENTIONS.items():
        values: dict[str, str] = {}
        for label, what in keys:
            if labels.get(label):
                values[what] = labels[label]
        tiers: dict[int, str] = {}
        if convention == "topograph":
            for k, v in labels.items():
                m = _TOPOGRAPH_TIER.match(k)
                if m and v:
                    tiers[int(m.group(1))] = v
        elif convention == "aws":
            layers = {int(m.group(1)): v for k, v in labels.items() if (m := _AWS_LAYER.match(k)) and v}
            if layers:
                top = max(4 if 4 in layers else 3, max(layers))
                tiers = {top - n: v for n, v in layers.items()}
        for what, v in values.items():
            if what.startswith("tier"):
                tiers[int(what[4:])] = v
        if not values and not tiers:
            continue
        depth = max(tiers) + 1 if tiers else 0
        place = Place(nvlink=values.get("nvlink"), nvlink_sub=values.get("nvlink_sub"),
                      switches=tuple(tiers.get(i) for i in range(depth)), rack=values.get("rack"), power=values.get("power"))
        out.append(Reading(node, f"{source} labels ({convention})", place, LABEL_NAMESPACES.get(convention, "")))
    return out


# -- NVML ---------------------------------------------------------------------------------------------
def from_nvml_fabric(node: str, gpus: Sequence[tuple[str, int]], source: str = "nvml fabric info") -> list[Reading]:
    """``gpus``: (cluster UUID, clique id) per GPU whose fabric registration completed; the NVLink
    domain is ``<uuid>.<clique>`` (the GPU operator's ``nvidia.com/gpu.clique`` spelling). GPUs of
    one node in two cliques are a contradiction. No GPU registered: no reading (not an error)."""
    ids = {f"{u}.{c}" for u, c in gpus if u and set(u) - set("0-")}
    if not ids:
        return []
    if len(ids) > 1:
        raise TopologyConflict(f"node {node}: {source} puts its GPUs in {len(ids)} NVLink cliques: {', '.join(sorted(ids))}")
    return [Reading(node, source, Place(nvlink=ids.pop()), "nvidia")]


def read_nvml_fabric(node: str) -> list[Reading]:  # pragma: no cover - needs NVML with a registered fabric
    """This node's NVLink domain from NVML (``nvmlDeviceGetGpuFabricInfo``); [] when NVML or the
    call is unavailable (no NVSwitch fabric: the domain is the node itself)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                info = pynvml.nvmlDeviceGetGpuFabricInfo(h)
            except (pynvml.NVMLError, AttributeError):
                continue
            if getattr(info, "state", None) == getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3) and info.status == 0:
                raw = bytes(info.clusterUuid)
                gpus.append(("-".join(f"{b:02x}" for b in raw), int(info.cliqueId)))
        return from_nvml_fabric(node, gpus)
    finally:
        pynvml.nvmlShutdown()


# -- a plain file -------------------------------------------------------------------------------------
_FILE_KEYS = {"nvlink", "nvlink_sub", "switches", "rack", "power"}


def parse_file(text: str, source: str, *, json_format: bool = False) -> list[Reading]:
    try:
        data = json.loads(text) if json_format else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise TopologyError(f"{source}: not valid {'JSON' if json_format else 'TOML'}: {exc}") from None
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, dict):
        raise TopologyError(f"{source}: needs a [nodes.<name>] table per node")
    extra = set(data) - {"nodes"}
    if extra:
        raise TopologyError(f"{source}: unknown key {sorted(extra)[0]!r} (known: nodes)")
    out = []
    for node, entry in nodes.items():
        where = f"{source}: nodes.{node}"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where}: must be a table")
        unknown = set(entry) - _FILE_KEYS
        if unknown:
            raise TopologyError(f"{where}.{sorted(unknown)[0]}: unknown key (known: {', '.join(sorted(_FILE_KEYS))})")
        for key in ("nvlink", "nvlink_sub", "rack", "power"):
            if key in entry and (not isinstance(entry[key], str) or not entry[key]):
                raise TopologyError(f"{where}.{key}: must be a non-empty string")
        switches = entry.get("switches", [])
        if not isinstance(switches, list) or not all(isinstance(s, str) for s in switches):
            raise TopologyError(f"{where}.switches: must be a list of switch names, nearest first (\"\" = unknown)")
        out.append(Reading(node, source, Place(nvlink=entry.get("nvlink"), nvlink_sub=entry.get("nvlink_sub"),
                                               switches=tuple(s or None for s in switches), rack=entry.get("rack"),
                                               power=entry.get("power"))))
    return out


def read_file(path: str) -> list[Reading]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read the topology file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TopologyError(f"{path}: not a UTF-8 text file") from None
    return parse_text(text, path)


def parse_text(text: str, path: str) -> list[Reading]:
    """A topology file's text: Slurm topology.conf syntax, else TOML (JSON when ``path`` ends in .json)."""
    lowered = text.lower()
    if "switchname=" in lowered or "blockname=" in lowered:
        return parse_slurm_topology(text, path)
    return parse_file(text, path, json_format=path.endswith(".json"))


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
    recent = {n for n, t in cordons if n != node and now - window_seconds <= t <= now + 60}
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
        recent = {n: t for n, t in cordons if n in members and now - window_seconds <= t <= now + 60}
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


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


__all__ = [
    "Distance", "DomainVerdict", "domain_settle", "domain_slots", "Place", "Reading", "ReplicaPlan", "SpareChoice", "Topology", "TopologyConflict",
    "TopologyError", "choose_spare", "distance", "domain_breaker", "expand_hostlist", "failure_domain", "from_labels",
    "from_nvml_fabric", "merge", "parse_file", "parse_slurm_topology", "parse_text", "read_file", "replica_plan",
]
