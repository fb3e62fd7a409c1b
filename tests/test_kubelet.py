"""The shipped DaemonSet as a pod on a real kubelet (tests/kubelet_node.py: Debian's containerd and
runc, the kubelet, controller-manager and scheduler built from Debian's `kubernetes` source): the
image scripts/build-image makes, imported into containerd; the shipped simulated overlay (its
ServiceAccount, RBAC, ConfigMap, DaemonSet and Service, rendered by `kubectl kustomize`) applied; the pod Running with its liveness probe
passing; an Xid 79 injected through the simulated state cordons the Node through the pod's own
ServiceAccount token (the apiserver's audit log names the user); Prometheus scrapes the pod."""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO, wait_for
from kube_cluster import kustomize
from oci_image import REF, build_image
from oci_image import missing as image_missing
from prom_server import Prometheus

pytestmark = [pytest.mark.needs_root, pytest.mark.needs_kube, pytest.mark.slow]
SIMULATED = REPO / "deploy" / "kubernetes" / "overlays" / "simulated"


@pytest.fixture(scope="module")
def node():
    from kubelet_node import missing, start_node

    why = missing() or image_missing()
    if why:
        pytest.skip(f"a kubelet node needs {why}")
    n = start_node([build_image()])
    try:
        yield n
    finally:
        n.stop()


def ci_overlay(node, sim_dir, host_dir) -> list[dict]:
    """The shipped simulated overlay (deploy/kubernetes/overlays/simulated, rendered by `kubectl
    kustomize`: simulated GPUs, no eBPF and no kernel log, which other tests write to) with what
    this machine needs, and nothing else: the simulated state, runtime and state directories under
    the test's directory instead of the host's, the in-cluster config pointed at the apiserver's
    bridge address (no kube-proxy here), and a breaker that lets the only node of the cluster be
    cordoned."""
    out = []
    for doc in kustomize(SIMULATED):
        if doc["kind"] == "ConfigMap":
            toml = doc["data"]["sentinel.toml"]
            doc["data"]["sentinel.toml"] = toml.replace('backend = "kubernetes"\n',
                                                        'backend = "kubernetes"\nbreaker_max_fraction = 1.0\n', 1)
        if doc["kind"] == "DaemonSet":
            spec = doc["spec"]["template"]["spec"]
            (c,) = spec["containers"]
            assert c["args"][-4:] == ["--simulate", "/sim/gpus.json", "--no-ebpf", "--no-kernel-log"], c["args"]
            c["env"] += [{"name": "KUBERNETES_SERVICE_HOST", "value": node.gateway},
                         {"name": "KUBERNETES_SERVICE_PORT", "value": str(node.cluster.port)}]
            paths = {"run": host_dir / "run", "state": host_dir / "state", "sim": sim_dir}
            for v in spec["volumes"]:
                if v["name"] in paths:
                    v["hostPath"]["path"] = str(paths.pop(v["name"]))
            assert not paths, f"the overlay lost the volumes {sorted(paths)}"
        out.append(doc)
    return out


def test_the_daemonset_pod_runs_and_cordons_its_node_through_its_serviceaccount(node, sim_state, tmp_path):
    from kubernetes import utils

    from sentinel.sources import simulated

    for doc in ci_overlay(node, sim_state.parent, tmp_path):
        utils.create_from_dict(node.cluster.api, doc)
    core = node.cluster.core()

    def running_pod():
        pods = core.list_namespaced_pod("sentinel", label_selector="app.kubernetes.io/name=sentinel").items
        ready = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip
                 and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
        return ready[0] if ready else None

    pod = node.wait(running_pod, 300, "the DaemonSet's pod Running and Ready")
    assert pod.spec.node_name == node.name and pod.spec.service_account_name == "sentinel"
    (status,) = pod.status.container_statuses
    assert status.image == REF or status.image.endswith(REF), status.image
    assert any(v.secret and v.secret.secret_name.startswith("sentinel-token-") for v in pod.spec.volumes), \
        "the ServiceAccount admission mounted the pod's own token"

    # liveness: the kubelet's prober ran /livez at least twice and it passed (--v=3 logs each)
    # (prober.go: "<probe> probe for \"<pod>_<namespace>(<uid>):<container>\" succeeded")
    probe = re.compile(rf'Liveness probe for "{re.escape(pod.metadata.name)}_sentinel\([^)]*\):sentinel" succeeded')
    node.wait(lambda: len(probe.findall((node.root / "kubelet.log").read_text(errors="replace"))) >= 2, 90,
              "two passing liveness probes")
    assert core.read_namespaced_pod(pod.metadata.name, "sentinel").status.container_statuses[0].restart_count == 0

    # Prometheus scrapes the pod on its own IP, as the headless Service / PodMonitor would
    prom = Prometheus(tmp_path, [f"{pod.status.pod_ip}:9477"], [REPO / "monitoring" / "alerts.yml"])
    try:
        wait_for(lambda: len(prom.query("sentinel_gpu_health == 0")) == 4, timeout=90, interval=0.5,
                 what="Prometheus to scrape four healthy GPUs from the pod")

        simulated.inject(sim_state, 0, ["xid=79"])

        def cordoned():
            n = core.read_node(node.name)
            tainted = any(t.key.startswith("sentinel.dev/") for t in n.spec.taints or [])
            unhealthy = any(c.type == "GPUHealthy" and c.status == "False" for c in n.status.conditions or [])
            return n if n.spec.unschedulable and tainted and unhealthy else None

        node.wait(cordoned, 90, "the Node cordoned, tainted and GPUHealthy=False, by the pod")
        # who did it: the apiserver's audit log names the pod's ServiceAccount as the user of the
        # successful patches of the Node and of its status (the kubelet patches them too, as admin)
        sa = "system:serviceaccount:sentinel:sentinel"
        events = [json.loads(line) for line in (node.root / "audit.log").read_text().splitlines()]
        by_sa = {e["objectRef"].get("subresource", "") for e in events if e["user"]["username"] == sa
                 and e["verb"] == "patch" and e["objectRef"].get("name") == node.name
                 and e.get("responseStatus", {}).get("code", 0) < 300 and e["stage"] == "ResponseComplete"}
        assert by_sa == {"", "status"}, [(e["user"]["username"], e["verb"], e["objectRef"]) for e in events]
        wait_for(lambda: prom.query("sentinel_node_cordoned == 1"), timeout=60, interval=0.5,
                 what="sentinel_node_cordoned == 1 in Prometheus")
        firing = wait_for(lambda: prom.firing("SentinelGPUFailed"), timeout=60, interval=0.5,
                          what="SentinelGPUFailed to fire")
        assert [a["labels"]["gpu"] for a in firing] == ["0"]
    finally:
        prom.stop()
