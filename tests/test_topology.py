"""The topology model, the nearest spare, the replica placement and the per-domain breaker: pure."""

from __future__ import annotations

import itertools
import random

import pytest

from sentinel import topology as T

TREE = """
# two leaves under one spine, a third leaf under another spine, both under a core
SwitchName=leafA Nodes=node[1-2,4]
SwitchName=leafB Nodes=node3,node5
SwitchName=leafC Nodes=node[6-7]
SwitchName=spine1 Switches=leafA,leafB
SwitchName=spine2 Switches=leafC
SwitchName=core Switches=spine[1-2]
"""


def tree() -> T.Topology:
    return T.merge(T.parse_slurm_topology(TREE))


def test_hostlist_expansion():
    assert T.expand_hostlist("node[1-3,7],gpu[08-10]-a,x") == ["node1", "node2", "node3", "node7", "gpu08-a", "gpu09-a",
                                                               "gpu10-a", "x"]
    assert T.expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(T.TopologyError, match="unbalanced"):
        T.expand_hostlist("node[1-3")


def test_slurm_tree_gives_switch_paths():
    topo = tree()
    assert topo.place("node4").switches == ("leafA", "spine1", "core")
    assert topo.place("node5").switches == ("leafB", "spine1", "core")
    assert topo.place("node6").switches == ("leafC", "spine2", "core")
    assert topo.groups("leaf") == {frozenset({"node1", "node2", "node4"}), frozenset({"node3", "node5"}),
                                   frozenset({"node6", "node7"})}
    assert T.distance(topo, "node2", "node4").name == "leaf"
    assert T.distance(topo, "node2", "node3").name == "spine"
    assert T.distance(topo, "node2", "node6").name == "core"


def test_scontrol_show_topology_output_parses_like_the_file():
    shown = ("SwitchName=leafA Level=0 LinkSpeed=1 Nodes=node[1-2,4] Switches=(null)\n"
             "SwitchName=leafB Level=0 LinkSpeed=1 Nodes=node[3,5] Switches=(null)\n"
             "SwitchName=leafC Level=0 LinkSpeed=1 Nodes=node[6-7] Switches=(null)\n"
             "SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=node[1-5] Switches=leafA,leafB\n"
             "SwitchName=spine2 Level=1 LinkSpeed=1 Nodes=node[6-7] Switches=leafC\n"
             "SwitchName=core Level=2 LinkSpeed=1 Nodes=node[1-7] Switches=spine[1-2]\n")
    # scontrol lists every node under each of its ancestors too: only leaves' Nodes= place a node
    topo = T.merge(T.parse_slurm_topology(shown, "scontrol show topology"))
    assert topo.places == tree().places


def test_slurm_block_topology_is_the_nvlink_domain():
    text = "BlockName=b1 Nodes=n[1-2]\nBlockName=b2 Nodes=n[3-4]\nBlockName=b3 Nodes=n[5-6]\nBlockSizes=2,4\n"
    topo = T.merge(T.parse_slurm_topology(text))
    assert topo.place("n1").nvlink == "b1"
    assert T.distance(topo, "n1", "n2").name == "nvlink"
    assert T.distance(topo, "n1", "n3").name == "leaf"  # the aggregate of b1 and b2
    assert T.distance(topo, "n1", "n5").name == "far"


@pytest.mark.parametrize("text,message", [
    ("SwitchName=a Nodes=n1\nSwitchName=b Nodes=n1\n", "node n1 is under two leaf switches, 'a'"),
    ("SwitchName=a Nodes=n1\nSwitchName=s1 Switches=a\nSwitchName=s2 Switches=a\n", "switch 'a' sits under both"),
    ("SwitchName=l Nodes=n1\nSwitchName=a Switches=l,b\nSwitchName=b Switches=a\n", "cycle"),
    ("SwitchName=a Nodes=n1\nSwitchName=a Nodes=n2\n", "defined twice"),
    ("BlockName=b1 Nodes=n1\nBlockName=b2 Nodes=n1\n", "node n1 is in two blocks"),
])
def test_contradictory_slurm_topology_names_source_and_node(text, message):
    with pytest.raises(T.TopologyConflict, match=message) as exc:
        T.merge(T.parse_slurm_topology(text, "/etc/slurm/topology.conf"))
    assert "/etc/slurm/topology.conf" in str(exc.value)


def test_bad_slurm_line_is_an_error_naming_the_line():
    with pytest.raises(T.TopologyError, match="topology.conf line 2"):
        T.parse_slurm_topology("SwitchName=a Nodes=n1\nNodeName=n2\n")


TOPOGRAPH = {
    "accelerator.topograph.run/domain": "nvl-1", "fabric.topograph.run/tier-0": "nn-leaf1",
    "fabric.topograph.run/tier-1": "nn-spine1", "fabric.topograph.run/tier-2": "nn-core",
}


def aws(leaf: str, spine: str, ultra: str) -> dict[str, str]:
    return {"topology.k8s.aws/network-node-layer-3": leaf, "topology.k8s.aws/network-node-layer-2": spine,
            "topology.k8s.aws/network-node-layer-1": "nn-core", "topology.k8s.aws/ultraserver-id": ultra}


def test_topograph_and_aws_labels_give_the_same_model():
    topograph = T.merge(T.from_labels("a", TOPOGRAPH) + T.from_labels(
        "b", {**TOPOGRAPH, "accelerator.topograph.run/domain": "nvl-2", "fabric.topograph.run/tier-0": "nn-leaf2"}))
    cloud = T.merge(T.from_labels("a", aws("nn-leaf1", "nn-spine1", "nvl-1")) + T.from_labels(
        "b", aws("nn-leaf2", "nn-spine1", "nvl-2")))
    assert topograph.places == cloud.places
    assert cloud.place("a").switches == ("nn-leaf1", "nn-spine1", "nn-core")


def test_older_topograph_gcp_and_gpu_operator_labels():
    legacy = T.from_labels("n", {"network.topology.nvidia.com/accelerator": "d", "network.topology.nvidia.com/block": "l",
                                 "network.topology.nvidia.com/spine": "s"})
    assert legacy[0].place == T.Place(nvlink="d", switches=("l", "s"))
    gcp = T.from_labels("n", {"cloud.google.com/gce-topology-block": "blk", "cloud.google.com/gce-topology-subblock": "sb",
                              "cloud.google.com/gce-topology-host": "h"})
    assert gcp[0].place.switches == ("sb", "blk")
    clique = T.from_labels("n", {"nvidia.com/gpu.clique": "7f3c.1"})
    assert clique[0].place.nvlink == "7f3c.1"


def test_label_conventions_that_group_nodes_differently_are_a_conflict():
    # Topograph says a and b share an NVLink domain; the GPU operator's clique says they do not
    readings = (T.from_labels("a", {"accelerator.topograph.run/domain": "d1", "nvidia.com/gpu.clique": "u.1"})
                + T.from_labels("b", {"accelerator.topograph.run/domain": "d1", "nvidia.com/gpu.clique": "u.2"}))
    with pytest.raises(T.TopologyConflict, match=r"node b: .*topograph.* same nvlink domain as a") as exc:
        T.merge(readings)
    assert "gpu-operator" in str(exc.value)


def test_conventions_may_name_domains_differently_if_they_group_alike():
    readings = []
    for node, domain, ultra in (("a", "uuid.1", "us-1"), ("b", "uuid.1", "us-1"), ("c", "uuid.2", "us-2")):
        readings += T.from_labels(node, {"accelerator.topograph.run/domain": domain, "topology.k8s.aws/ultraserver-id": ultra})
    topo = T.merge(readings)
    assert topo.groups("nvlink") == {frozenset({"a", "b"}), frozenset({"c"})}
    assert topo.place("a").nvlink == "uuid.1"  # the first convention's name
    # ... but within one namespace a different name is a contradiction (Topograph vs the GPU operator)
    with pytest.raises(T.TopologyConflict, match="node a: .*topograph.* says NVLink domain 'uuid.1'"):
        T.merge(T.from_labels("a", {"accelerator.topograph.run/domain": "uuid.1", "nvidia.com/gpu.clique": "uuid.9"}))


def test_two_sources_naming_a_node_differently_is_a_conflict():
    a = T.parse_file('[nodes.n1]\nrack = "r1"\n', "/etc/sentinel/topology.toml")
    b = T.parse_file('[nodes.n1]\nrack = "r2"\n', "other.toml")
    with pytest.raises(T.TopologyConflict) as exc:
        T.merge(a + b)
    assert "node n1" in str(exc.value) and "/etc/sentinel/topology.toml" in str(exc.value) and "other.toml" in str(exc.value)


def test_a_leaf_under_two_spines_across_nodes_is_a_conflict():
    text = '[nodes.n1]\nswitches = ["leaf", "s1"]\n[nodes.n2]\nswitches = ["leaf", "s2"]\n'
    with pytest.raises(T.TopologyConflict, match="node n2: its leaf switch 'leaf' sits under 's2'.*'s1' for node n1"):
        T.merge(T.parse_file(text, "t.toml"))


def test_partial_topology_is_a_reading_and_sources_fill_each_other():
    tree_part = T.parse_slurm_topology("SwitchName=l1 Nodes=n[1-2]\nSwitchName=s Switches=l1\n")
    racks = T.parse_file('[nodes.n1]\nrack = "r1"\n[nodes.n3]\nrack = "r3"\n', "racks.toml")
    topo = T.merge(tree_part + racks)
    assert topo.place("n1") == T.Place(switches=("l1", "s"), rack="r1")
    assert topo.place("n3") == T.Place(rack="r3")
    assert topo.place("nowhere") == T.Place()
    assert set(topo.sources["n1"]) == {"topology.conf (topology/tree)", "racks.toml"}


def test_file_errors_name_the_key():
    with pytest.raises(T.TopologyError, match=r"t.toml: nodes.n1.leaf: unknown key"):
        T.parse_file('[nodes.n1]\nleaf = "x"\n', "t.toml")
    with pytest.raises(T.TopologyError, match=r"nodes.n1.switches: must be a list"):
        T.parse_file('[nodes.n1]\nswitches = "x"\n', "t.toml")
    with pytest.raises(T.TopologyError, match="not valid TOML"):
        T.parse_file("[nodes", "t.toml")


def test_nvml_fabric_clique():
    assert T.from_nvml_fabric("n", [("abc", 1), ("abc", 1)])[0].place.nvlink == "abc.1"
    assert T.from_nvml_fabric("n", [("00000000-0000", 0)]) == []  # not registered: no reading
    with pytest.raises(T.TopologyConflict, match="node n: nvml fabric info puts its GPUs in 2 NVLink cliques"):
        T.from_nvml_fabric("n", [("abc", 1), ("abc", 2)])


# -- the nearest spare ----------------------------------------------------------------------------------
def test_nearest_spare_prefers_nvlink_then_leaf_then_spine():
    text = ('[nodes.d]\nnvlink = "x"\nswitches = ["lA", "s1"]\n'
            '[nodes.far]\nswitches = ["lZ", "s9"]\n[nodes.spine]\nswitches = ["lB", "s1"]\n'
            '[nodes.leaf]\nnvlink = "y"\nswitches = ["lA", "s1"]\n[nodes.nv]\nnvlink = "x"\nswitches = ["lC", "s1"]\n')
    topo = T.merge(T.parse_file(text, "t"))
    order = ["far", "spine", "leaf", "nv"]
    c = T.choose_spare(topo, "d", order)
    assert (c.node, c.distance) == ("nv", "nvlink")
    c = T.choose_spare(topo, "d", order[:3])
    assert (c.node, c.distance) == ("leaf", "leaf") and "lA" in c.why and "no waiting spare in its NVLink domain x" in c.why
    assert T.choose_spare(topo, "d", order[:2]).node == "spine"
    c = T.choose_spare(topo, "d", ["far"])
    assert (c.node, c.distance) == ("far", "far")


def test_unknown_topology_degrades_to_the_first_waiting_spare():
    topo = T.merge([])
    c = T.choose_spare(topo, "n2", ["s3", "s1", "s2"])
    assert (c.node, c.distance) == ("s3", "unknown") and "first waiting spare" in c.why
    # the departed node is placed, the spares are not: still the first one
    topo = T.merge(T.parse_file('[nodes.n2]\nswitches = ["l"]\n', "t"))
    assert T.choose_spare(topo, "n2", ["s3", "s1"]).node == "s3"
    assert T.choose_spare(topo, "n2", []) is None


def test_choice_on_the_two_leaf_slurm_tree():
    topo = tree()
    c = T.choose_spare(topo, "node2", ["node3", "node4"])  # node3 under leafB comes first in the allocation
    assert (c.node, c.distance) == ("node4", "leaf") and "leafA" in c.why


# -- replicas --------------------------------------------------------------------------------------------
def rack_topology(racks: int, per_rack: int, leaves_per_spine: int = 2, rack_per_leaf: int = 1) -> tuple[T.Topology, list[str]]:
    readings, nodes = [], []
    for r in range(racks):
        leaf = f"leaf{r // rack_per_leaf}"
        spine = f"spine{(r // rack_per_leaf) // leaves_per_spine}"
        for k in range(per_rack):
            n = f"r{r}n{k}"
            nodes.append(n)
            readings.append(T.Reading(n, "t", T.Place(nvlink=f"nvl{r}", switches=(leaf, spine), rack=f"rack{r}")))
    return T.merge(readings), nodes


def check_plan(topo, nodes, plan):
    assert sorted(plan.holder) == list(range(len(nodes)))  # a permutation: everyone keeps exactly one replica
    assert all(h != i for i, h in enumerate(plan.holder))
    for i, h in enumerate(plan.holder):
        if nodes[i] not in plan.shared:
            assert topo.place(nodes[i]).rack != topo.place(nodes[h]).rack


def test_replica_leaves_the_rack_and_stays_under_the_leaf_when_it_can():
    # two racks per leaf: every replica goes to the other rack under the same leaf
    topo, nodes = rack_topology(racks=4, per_rack=3, rack_per_leaf=2)
    plan = T.replica_plan(topo, nodes)
    check_plan(topo, nodes, plan)
    assert not plan.shared
    for i, h in enumerate(plan.holder):
        assert T.distance(topo, nodes[i], nodes[h]).name == "leaf"


def test_replica_with_one_rack_per_leaf_goes_to_the_same_spine():
    topo, nodes = rack_topology(racks=4, per_rack=2, rack_per_leaf=1, leaves_per_spine=2)
    plan = T.replica_plan(topo, nodes)
    check_plan(topo, nodes, plan)
    assert {T.distance(topo, nodes[i], nodes[h]).name for i, h in enumerate(plan.holder)} == {"spine"}


def test_the_old_ring_keeps_replicas_in_the_rack():
    topo, nodes = rack_topology(racks=4, per_rack=4, rack_per_leaf=2)
    same = sum(topo.place(nodes[i]).rack == topo.place(nodes[(i + 1) % len(nodes)]).rack for i in range(len(nodes)))
    assert same == 12  # what (n + 1) mod N does in a real rack; replica_plan: 0 (above)


def test_replica_plan_property_random_topologies():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 24)
        racks = rng.randint(1, 6)
        readings = [T.Reading(f"n{i}", "t", T.Place(switches=(f"l{rng.randint(0, 3)}", "s"), rack=f"r{rng.randint(0, racks)}"))
                    for i in range(n)]
        topo = T.merge(readings)
        nodes = [f"n{i}" for i in range(n)]
        plan = T.replica_plan(topo, nodes)
        check_plan(topo, nodes, plan)
        biggest = max(len(g) for g in topo.groups("rack"))
        if biggest <= n // 2:
            assert not plan.shared, (nodes, plan)
        assert T.replica_plan(topo, nodes) == plan  # deterministic: every rank computes the same


def test_replica_plan_without_topology_is_the_old_ring():
    plan = T.replica_plan(T.merge([]), ["a", "b", "c"])
    assert plan.holder == (1, 2, 0) and not plan.topology_used
    assert plan.source == (2, 0, 1)


# -- the per-domain breaker -------------------------------------------------------------------------------
def nvl_topology() -> T.Topology:
    readings = [T.Reading(f"n{i}", "t", T.Place(nvlink=f"nvl{i // 4}", switches=(f"leaf{i // 8}",))) for i in range(16)]
    readings.append(T.Reading("solo", "t", T.Place(nvlink="solo-domain")))
    return T.merge(readings)


def test_domain_breaker_refuses_most_of_one_nvlink_domain():
    topo = nvl_topology()
    limits = {"nvlink": 0.5, "leaf": 0.5}
    now = 1000.0
    v = T.domain_breaker(topo, "n2", [("n0", now - 10)], now, window_seconds=300, max_fraction=limits)
    assert v.allowed  # 2 of 4
    v = T.domain_breaker(topo, "n2", [("n0", now - 10), ("n1", now - 5)], now, window_seconds=300, max_fraction=limits)
    assert not v.allowed and v.level == "nvlink" and v.domain == "nvl0" and "page" in v.why and "3 of the 4" in v.why
    # old cordons (outside the window) and other domains do not count
    v = T.domain_breaker(topo, "n2", [("n0", now - 900), ("n1", now - 900), ("n4", now)], now, window_seconds=300,
                         max_fraction=limits)
    assert v.allowed


def test_a_clock_skew_never_opens_the_domain_breaker():
    """Cordons stamped by a clock ahead of this node's (slurmctld's, another node's) still count."""
    topo = nvl_topology()
    limits = {"nvlink": 0.5}
    now = 1000.0
    ahead = [("n0", now + 120), ("n1", now + 3600)]
    v = T.domain_breaker(topo, "n2", ahead, now, window_seconds=300, max_fraction=limits)
    assert not v.allowed and v.level == "nvlink"


def test_domain_breaker_leaf_limit_across_domains():
    topo = nvl_topology()
    now = 0.0
    cordons = [("n0", now), ("n4", now), ("n5", now), ("n1", now)]  # leaf0 has n0..n7
    v = T.domain_breaker(topo, "n6", cordons, now, window_seconds=60, max_fraction={"nvlink": 1.0, "leaf": 0.5})
    assert not v.allowed and v.level == "leaf" and v.domain == "leaf0"


def test_domain_breaker_ignores_one_node_and_unknown_domains():
    topo = nvl_topology()
    assert T.domain_breaker(topo, "solo", [], 0.0, window_seconds=60, max_fraction={"nvlink": 0.1}).allowed
    assert T.domain_breaker(topo, "stranger", [("n0", 0.0)], 0.0, window_seconds=60, max_fraction={"nvlink": 0.1}).allowed


def test_every_pair_distance_is_symmetric_on_the_tree():
    topo = tree()
    for a, b in itertools.combinations(sorted(topo.places), 2):
        assert T.distance(topo, a, b) == T.distance(topo, b, a)


def test_domain_settle_keeps_a_burst_inside_one_domain_within_the_share():
    """Three nodes of one 4-node NVLink domain drain at the same moment, then each recounts: the
    deterministic order keeps two (50 %) and the third undoes its drain; after it has, the two
    that waited win."""
    topo = nvl_topology()
    limits = {"nvlink": 0.5}
    now = 100.0
    burst = [("n0", now), ("n1", now), ("n2", now)]
    outcomes = {n: T.domain_settle(topo, n, burst, now, window_seconds=60, max_fraction=limits) for n, _ in burst}
    assert {n: o for n, (o, _) in outcomes.items()} == {"n0": "wait", "n1": "wait", "n2": "lost"}
    assert outcomes["n2"][1].level == "nvlink" and "3 of the 4 nodes" in outcomes["n2"][1].why
    kept = [c for c in burst if c[0] != "n2"]  # n2 resumed itself
    assert all(T.domain_settle(topo, n, kept, now, window_seconds=60, max_fraction=limits)[0] == "won" for n, _ in kept)
    # the one-shot check agrees with the settled state: a fourth node of the domain is refused
    assert not T.domain_breaker(topo, "n3", kept, now, window_seconds=60, max_fraction=limits).allowed
