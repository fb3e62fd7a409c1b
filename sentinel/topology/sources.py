"""Topology readers: Slurm topology.conf / scontrol show topology (tree, block), Kubernetes node
labels (Topograph, GPU operator, GCP, AWS, Sentinel's), NVML's fabric clique, a plain file."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Mapping, Sequence

from sentinel.topology.model import Place, Reading, TopologyConflict, TopologyError

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
