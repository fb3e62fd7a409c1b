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

from sentinel.topology.choice import (FAR_RANK, UNKNOWN_RANK, Distance, DomainVerdict, ReplicaPlan, SpareChoice,
                                      choose_spare, distance, domain_breaker, domain_settle, domain_slots,
                                      failure_domain, replica_plan)
from sentinel.topology.model import (TIER_NAMES, Place, Reading, Topology, TopologyConflict, TopologyError, merge,
                                     natural, tier_name)
from sentinel.topology.sources import (LABEL_CONVENTIONS, LABEL_NAMESPACES, expand_hostlist, from_labels,
                                       from_nvml_fabric, parse_file, parse_slurm_topology, parse_text, read_file,
                                       read_nvml_fabric)

__all__ = [
    "FAR_RANK", "LABEL_CONVENTIONS", "LABEL_NAMESPACES", "TIER_NAMES", "UNKNOWN_RANK", "Distance", "DomainVerdict",
    "Place", "Reading", "ReplicaPlan", "SpareChoice", "Topology", "TopologyConflict", "TopologyError", "choose_spare",
    "distance", "domain_breaker", "domain_settle", "domain_slots", "expand_hostlist", "failure_domain", "from_labels",
    "from_nvml_fabric", "merge", "natural", "parse_file", "parse_slurm_topology", "parse_text", "read_file",
    "read_nvml_fabric", "replica_plan", "tier_name",
]
