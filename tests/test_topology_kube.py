"""Topology from Node labels on a real kube-apiserver (tests/kube_cluster.py): the same cluster
labelled in Topograph's conventions and in AWS's gives the same model, and the Kubernetes
backend — with deploy/kubernetes' ServiceAccount and RBAC — labels the same nearest spare."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sentinel import topology
from sentinel.backends import make_backend
from sentinel.backends.base import BackendContext
from sentinel.config import ActionsConfig, KubernetesConfig, TopologyConfig
from test_kubernetes import sa_kubeconfig  # noqa: F401 - the fixture (kube is session-wide, in conftest)

pytestmark = pytest.mark.needs_kube

# (node, NVLink domain, leaf, spine, spare?) — "far" comes first in name order, "near" shares the leaf
LAYOUT = (
    ("a-far", "nvl-9", "nn-leaf2", "nn-spine1", True),
    ("b-n1", "nvl-1", "nn-leaf1", "nn-spine1", False),
    ("b-n2", "nvl-1", "nn-leaf1", "nn-spine1", False),
    ("c-near", "nvl-5", "nn-leaf1", "nn-spine1", True),
    ("d-other", "nvl-7", "nn-leaf3", "nn-spine2", True),
)


def topograph(nvl, leaf, spine):
    return {"accelerator.topograph.run/domain": nvl, "fabric.topograph.run/tier-0": leaf,
            "fabric.topograph.run/tier-1": spine, "fabric.topograph.run/tier-2": "nn-core"}


def aws(nvl, leaf, spine):
    return {"topology.k8s.aws/ultraserver-id": nvl, "topology.k8s.aws/network-node-layer-3": leaf,
            "topology.k8s.aws/network-node-layer-2": spine, "topology.k8s.aws/network-node-layer-1": "nn-core"}


@pytest.fixture(scope="module")
def labelled(kube):  # noqa: F811
    from kubernetes import client

    core = kube.core()
    for prefix, labels in (("tg", topograph), ("aws", aws)):
        for name, nvl, leaf, spine, spare in LAYOUT:
            meta = {"sentinel.test/conv": prefix, **labels(nvl, leaf, spine)}
            if spare:
                meta["sentinel.dev/spare"] = "true"
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=f"{prefix}-{name}", labels=meta)))
    # no kubelet: made Ready and untainted by hand, as kube_cluster does for its own nodes
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for prefix in ("tg", "aws"):
        for name, *_ in LAYOUT:
            core.patch_node(f"{prefix}-{name}", {"spec": {"taints": None}})
            core.patch_node_status(f"{prefix}-{name}", {"status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fixture",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
    return kube


def backend(kubeconfig: Path, node: str, tmp_path: Path, conv: str):
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    actions = ActionsConfig(backend="kubernetes", kubernetes=KubernetesConfig(kubeconfig=str(kubeconfig)),
                            topology=TopologyConfig(spare_selector=f"sentinel.dev/spare=true,sentinel.test/conv={conv}"))
    return make_backend(actions, BackendContext(node=node, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                                                timeout=10.0, wall=time.time))


def renamed(topo: topology.Topology, prefix: str) -> dict:
    return {n[len(prefix) + 1:]: p for n, p in topo.places.items() if n.startswith(prefix + "-")}


def test_topograph_and_aws_labels_give_the_same_model_and_the_same_spare(labelled, sa_kubeconfig, tmp_path):  # noqa: F811
    tg = backend(sa_kubeconfig, "tg-b-n2", tmp_path / "tg", "tg")
    cloud = backend(sa_kubeconfig, "aws-b-n2", tmp_path / "aws", "aws")
    model_tg, model_aws = tg.topology(), cloud.topology()
    assert renamed(model_tg, "tg") == renamed(model_aws, "aws")
    assert model_tg.place("tg-b-n2") == topology.Place(nvlink="nvl-1", switches=("nn-leaf1", "nn-spine1", "nn-core"))
    chosen = {}
    for prefix, b in (("tg", tg), ("aws", cloud)):
        said = b.start_spare()
        assert b.spare_choice is not None, said
        chosen[prefix] = (b.spare_choice.node[len(prefix) + 1:], b.spare_choice.distance)
        node = labelled.core().read_node(b.spare_choice.node)
        assert node.metadata.labels.get("sentinel.dev/preferred-spare") == "true"
        assert node.metadata.annotations["sentinel.dev/preferred-spare-for"] == f"{prefix}-b-n2"
        far = labelled.core().read_node(f"{prefix}-a-far")
        assert "sentinel.dev/preferred-spare" not in (far.metadata.labels or {})
    assert chosen["tg"] == chosen["aws"] == ("c-near", "leaf")


def test_labels_that_contradict_each_other_are_reported_not_used(labelled, sa_kubeconfig, tmp_path):  # noqa: F811
    # the GPU operator's clique puts b-n1 and b-n2 apart while Topograph's domain puts them together
    core = labelled.core()
    core.patch_node("tg-b-n1", {"metadata": {"labels": {"nvidia.com/gpu.clique": "uuid.1"}}})
    core.patch_node("tg-b-n2", {"metadata": {"labels": {"nvidia.com/gpu.clique": "uuid.2"}}})
    try:
        b = backend(sa_kubeconfig, "tg-b-n2", tmp_path, "tg")
        with pytest.raises(topology.TopologyConflict, match=r"node tg-b-n2: .* same nvlink domain as tg-b-n1"):
            b.topology()
        said = b.start_spare()  # the spare request still goes out; the choice falls back to the controller's
        assert b.spare_choice is None and "reschedules" in said
        assert any("gpu-operator" in n for n in b.take_notes())
    finally:
        for n in ("tg-b-n1", "tg-b-n2"):
            core.patch_node(n, {"metadata": {"labels": {"nvidia.com/gpu.clique": None}}})


def test_the_lease_claim_refuses_most_of_one_nvlink_domain(labelled, sa_kubeconfig, tmp_path):  # noqa: F811
    """NVLink domain nvl-1 holds four Nodes here (b-n1, b-n2 of both label sets): with two of
    them claimed, a third (75 %) is refused under the same Lease while the fleet (3 of 14) would
    allow it; a node of another domain and leaf is not limited by it."""
    from sentinel.backends.base import CordonReason

    reason = CordonReason("xid", 0, "Xid 79 on GPU 0", "r")
    claimed = []
    try:
        for n in ("tg-b-n1", "aws-b-n1"):
            b = backend(sa_kubeconfig, n, tmp_path / n, "tg")
            assert b.claim_cordon(reason).allowed, b.take_notes()
            claimed.append(b)
        b = backend(sa_kubeconfig, "aws-b-n2", tmp_path / "aws-b-n2", "aws")
        verdict = b.claim_cordon(reason)
        assert not verdict.allowed and b.domain_refusal == "nvlink"
        assert "3 of the 4 nodes of nvlink domain nvl-1" in verdict.why and "page, do not drain" in verdict.why
        assert not labelled.core().read_node("aws-b-n2").spec.unschedulable  # nothing of Sentinel's on it
        other = backend(sa_kubeconfig, "tg-d-other", tmp_path / "other", "tg")
        assert other.claim_cordon(reason).allowed
        claimed.append(other)
    finally:
        for c in claimed:
            c.uncordon()
