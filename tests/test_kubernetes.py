"""The Kubernetes backend against a real kube-apiserver + etcd (tests/kube_cluster.py): cordon,
taint and the GPUHealthy condition on the Node; uncordon removes exactly Sentinel's; the
DaemonSet's ServiceAccount (deploy/kubernetes/, applied to the server) can do exactly what the
backend needs; a missing verb is named; the manifests pass server-side dry-run; the circuit
breaker trips at the threshold."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, register_agent, wait_for
from sentinel.backends import make_backend
from sentinel.backends.base import BackendContext, CordonReason, PermissionDenied, Unreachable, UnknownNode
from sentinel.channel import RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig, KubernetesConfig
from sentinel.migration import Migrator
from sentinel.policy import Trip

pytestmark = pytest.mark.needs_kube
DEPLOY = REPO / "deploy" / "kubernetes"
REASON = CordonReason("ecc_uncorrected", 3, "DBE count 1 >= 1", "req1", uuid="GPU-1234")
NEEDED = {("get", "nodes"), ("list", "nodes"), ("patch", "nodes"), ("patch", "nodes/status")}
# the circuit breaker's Lease (coordination.k8s.io, namespace sentinel): (verb, lease name or None)
LEASE_NEEDED = {("get", "sentinel-breaker"), ("update", "sentinel-breaker"), ("create", None)}
LEASE_NOT_NEEDED = {("delete", "sentinel-breaker"), ("list", None), ("watch", None), ("get", "kube-scheduler"),
                    ("update", "other"), ("patch", "sentinel-breaker")}
# verbs a node-health daemon must not have (a sample of the dangerous ones)
NOT_NEEDED = {("update", "nodes"), ("delete", "nodes"), ("create", "nodes"), ("watch", "nodes"), ("update", "nodes/status"),
              ("list", "pods"), ("delete", "pods"), ("create", "pods/eviction"), ("get", "secrets"), ("list", "secrets"),
              ("patch", "daemonsets"), ("get", "configmaps"), ("create", "serviceaccounts/token")}


@pytest.fixture
def clean(kube):
    yield kube
    kube.reset_nodes()
    reset_breaker(kube)


def reset_breaker(kube) -> None:
    """Remove the circuit breaker's Lease (its entries would count for the window)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        client.CoordinationV1Api(kube.api).delete_namespaced_lease("sentinel-breaker", "sentinel")
    except ApiException as exc:
        if exc.status != 404:
            raise


def docs(name: str) -> list[dict]:
    import yaml

    (path,) = DEPLOY.rglob(name)  # base/, overlays/*/, components/*/: each name once
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def apply(kube, name: str, dry_run: str | None = None) -> None:
    from kubernetes import utils

    for doc in docs(name):
        kw = {"dry_run": dry_run} if dry_run else {}
        try:
            utils.create_from_dict(kube.api, doc, **kw)
        except utils.FailToCreateError as exc:
            if not all(e.status == 409 for e in exc.api_exceptions):  # already there: applied by an earlier test
                raise


@pytest.fixture(scope="module")
def sa_kubeconfig(kube):
    """The DaemonSet's identity: deploy/kubernetes' ServiceAccount and RBAC, applied for real, and
    a token for it (TokenRequest, as the kubelet mounts into the pod)."""
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        apply(kube, name)
    return token_kubeconfig(kube, "sentinel", "sentinel")


def token_kubeconfig(kube, namespace: str, sa: str) -> Path:
    from kubernetes import client

    req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=["https://kubernetes.default.svc"],
                                                                             expiration_seconds=3600))
    tok = client.CoreV1Api(kube.api).create_namespaced_service_account_token(sa, namespace, req).status.token
    return kube.write_kubeconfig(kube.root / f"{sa}.kubeconfig", tok)


def backend(kube, kubeconfig: Path, node: str, tmp_path: Path, **keys):
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    actions = ActionsConfig(backend="kubernetes", kubernetes=KubernetesConfig(kubeconfig=str(kubeconfig), **keys))
    return make_backend(actions, BackendContext(node=node, state_dir=tmp_path / "state", runtime_dir=tmp_path / "run",
                                                timeout=10.0, wall=time.time))


def node(kube, name):
    return kube.core().read_node(name)


def condition(n, kind="GPUHealthy"):
    return next((c for c in n.status.conditions or [] if c.type == kind), None)


def test_cordon_taints_and_sets_the_condition_and_uncordon_removes_exactly_sentinels(clean, sa_kubeconfig, tmp_path):
    # an admin's taint is there before, and stays after
    clean.core().patch_node("node2", {"spec": {"taints": [{"key": "admin/maintenance", "value": "psu", "effect": "NoSchedule"}]}})
    b = backend(clean, sa_kubeconfig, "node2", tmp_path)
    b.check()
    b.cordon(REASON)
    n = node(clean, "node2")
    assert n.spec.unschedulable is True
    taints = {(t.key, t.value, t.effect) for t in n.spec.taints}
    assert taints == {("admin/maintenance", "psu", "NoSchedule"), ("sentinel.dev/gpu-failure", "ecc_uncorrected", "NoSchedule")}
    c = condition(n)
    assert (c.status, c.reason) == ("False", "EccUncorrected")
    assert "GPU 3 (GPU-1234)" in c.message and "DBE count 1 >= 1" in c.message
    assert condition(n, "Ready").status == "True"  # the other conditions are untouched
    state = b.is_cordoned()
    assert state.cordoned and state.by_sentinel
    b.cordon(REASON)  # idempotent: no second taint
    assert [t.key for t in node(clean, "node2").spec.taints].count("sentinel.dev/gpu-failure") == 1
    said = b.uncordon()
    assert "uncordoned" in said and "taint sentinel.dev/gpu-failure removed" in said
    n = node(clean, "node2")
    assert not n.spec.unschedulable
    assert [(t.key, t.value) for t in n.spec.taints] == [("admin/maintenance", "psu")]
    assert condition(n).status == "True" and condition(n, "Ready").status == "True"
    assert not (n.metadata.annotations or {}).get("sentinel.dev/cordoned")


def test_an_admins_cordon_stays_after_sentinels_uncordon(clean, sa_kubeconfig, tmp_path):
    clean.core().patch_node("node3", {"spec": {"unschedulable": True}})
    b = backend(clean, sa_kubeconfig, "node3", tmp_path)
    b.cordon(REASON)
    assert any("already cordoned by someone else" in n for n in b.take_notes())
    said = b.uncordon()
    assert "cordoned by someone else; that cordon stays" in said
    n = node(clean, "node3")
    assert n.spec.unschedulable is True  # the admin's
    assert not n.spec.taints  # Sentinel's taint is gone


def test_the_serviceaccount_can_do_exactly_what_the_backend_needs(kube, sa_kubeconfig):
    from kubernetes import client

    auth = client.AuthorizationV1Api(kube.api)
    user = "system:serviceaccount:sentinel:sentinel"

    def allowed(verb, resource):
        res, _, sub = resource.partition("/")
        review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user, groups=["system:serviceaccounts", "system:serviceaccounts:sentinel", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(verb=verb, resource=res, subresource=sub or None,
                                                            namespace=None if res in ("nodes",) else "sentinel")))
        return auth.create_subject_access_review(review).status.allowed

    assert {vr for vr in NEEDED if allowed(*vr)} == NEEDED
    assert {vr for vr in NOT_NEEDED if allowed(*vr)} == set()

    def lease_allowed(verb, name):
        review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
            user=user, groups=["system:serviceaccounts", "system:serviceaccounts:sentinel", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(verb=verb, resource="leases", group="coordination.k8s.io",
                                                            name=name, namespace="sentinel")))
        return auth.create_subject_access_review(review).status.allowed

    assert {vn for vn in LEASE_NEEDED if lease_allowed(*vn)} == LEASE_NEEDED
    assert {vn for vn in LEASE_NOT_NEEDED if lease_allowed(*vn)} == set()


def test_a_missing_verb_is_named_at_start_and_at_the_call(kube, sa_kubeconfig, tmp_path):
    from kubernetes import utils

    # the same role without nodes/status patch, bound to a second ServiceAccount
    role, binding = docs("rbac.yaml")[:2]  # the ClusterRole and its binding (not the breaker's Lease Role)
    role["metadata"]["name"] = "sentinel-no-status"
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["nodes/status"]]
    binding["metadata"]["name"] = "sentinel-no-status"
    binding["roleRef"]["name"] = "sentinel-no-status"
    binding["subjects"][0]["name"] = "sentinel-partial"
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "sentinel-partial", "namespace": "sentinel"}}
    for doc in (sa, role, binding):
        try:
            utils.create_from_dict(kube.api, doc)
        except utils.FailToCreateError as exc:
            assert all(e.status == 409 for e in exc.api_exceptions)
    partial = token_kubeconfig(kube, "sentinel", "sentinel-partial")
    b = backend(kube, partial, "node4", tmp_path)
    with pytest.raises(PermissionDenied) as exc:
        b.check()
    assert "'patch' on 'nodes/status'" in str(exc.value) and "rbac.yaml" in str(exc.value)
    with pytest.raises(PermissionDenied) as exc:
        b.cordon_scheduler(REASON)
    assert "needs the RBAC verb 'patch' on 'nodes/status'" in str(exc.value)
    kube.reset_nodes()


def test_an_unknown_node_is_a_clear_error_at_start(kube, sa_kubeconfig, tmp_path, sim_state):
    with pytest.raises(UnknownNode) as exc:
        backend(kube, sa_kubeconfig, "gpu-node-17", tmp_path).check()
    assert "'gpu-node-17' is not known to the Kubernetes API server" in str(exc.value)
    cfg = tmp_path / "k.toml"
    cfg.write_text(f'[daemon]\nnode_name = "gpu-node-17"\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/st"\n'
                   f'[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n[actions]\nbackend = "kubernetes"\n'
                   f'[actions.kubernetes]\nkubeconfig = "{sa_kubeconfig}"\n[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    r = subprocess.run([sys.executable, "-m", "sentinel", "run", "--config", str(cfg), "--simulate", str(sim_state)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "not known to the Kubernetes API server" in r.stderr, r.stderr


def test_an_api_server_that_does_not_answer_is_unreachable_within_the_timeout(kube, tmp_path):
    import socket

    with socket.socket() as s:  # a port that accepts and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        dead = kube.write_kubeconfig(tmp_path / "dead.kubeconfig", "x")
        dead.write_text(dead.read_text().replace(kube.url, f"https://127.0.0.1:{s.getsockname()[1]}"))
        actions = ActionsConfig(backend="kubernetes", kubernetes=KubernetesConfig(kubeconfig=str(dead)))
        b = make_backend(actions, BackendContext(node="node1", state_dir=tmp_path, runtime_dir=tmp_path, timeout=1.0,
                                                 wall=time.time))
        t0 = time.monotonic()
        with pytest.raises(Unreachable):
            b.check()
        assert time.monotonic() - t0 < 10


def test_the_manifests_pass_server_side_dry_run(kube, sa_kubeconfig):
    """Every built-in kind goes through the API server's validation and admission (dryRun=All).
    The PodMonitor is a custom resource: Debian's 1.20 kube-apiserver build panics serving custom
    objects, so it is checked here against the DaemonSet it must select (labels, port name)."""
    from kubernetes import utils

    seen = set()
    # the whole objects (base, the job-agents overlay's job, the PodMonitor component), not the patches
    whole = [*DEPLOY.glob("base/*.yaml"), *DEPLOY.glob("overlays/job-agents/training/*.yaml"),
             *DEPLOY.glob("components/*/*.yaml")]
    for path in sorted(p for p in whole if p.name != "kustomization.yaml"):
        for doc in docs(path.name):
            seen.add(doc["kind"])
            if doc["kind"] != "PodMonitor":
                apply(kube, path.name, dry_run="All")
    assert seen == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ConfigMap",
                    "DaemonSet", "Service", "PodMonitor", "Deployment", "Job"}
    # the example training job: the DaemonSet's runtime directory, its own pid namespace, not root
    job = next(d for d in docs("training-job.yaml") if d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    ds_run = next(v for v in docs("daemonset.yaml")[0]["spec"]["template"]["spec"]["volumes"] if v["name"] == "run")
    assert any(v.get("hostPath", {}).get("path") == ds_run["hostPath"]["path"] for v in spec["volumes"])
    assert spec["hostPID"] is False and spec["securityContext"]["runAsNonRoot"] is True
    (agent,) = spec["containers"]
    assert agent["command"][:2] == ["sentinel", "launch"] and "--rdzv-conf=is_host=false,keep_alive_interval=1," \
        "keep_alive_max_attempt=3" in agent["command"]
    ds = docs("daemonset.yaml")[0]
    pod = ds["spec"]["template"]
    (pm,) = docs("podmonitor.yaml")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    (svc,) = docs("service.yaml")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == docs("serviceaccount.yaml")[0]["metadata"]["name"]
    # the config the DaemonSet mounts is a valid Sentinel config for the kubernetes backend
    from sentinel import config

    toml = docs("configmap.yaml")[0]["data"]["sentinel.toml"]
    assert config.parse(toml).actions.backend == "kubernetes"
    # and a broken manifest is rejected, so the dry-run does check something
    bad = docs("daemonset.yaml")[0]
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 70000
    with pytest.raises(utils.FailToCreateError):
        utils.create_from_dict(kube.api, bad, dry_run="All")


def test_the_breaker_trips_at_the_threshold(clean, sa_kubeconfig, tmp_path):
    for name in ("node1", "node2"):  # half the GPU nodes cordoned by Sentinel in the window
        backend(clean, sa_kubeconfig, name, tmp_path / name, node_selector="nvidia.com/gpu.present=true").cordon(REASON)
    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    rank = RankEndpoint.open(run_dir)
    (tmp_path / "state").mkdir()
    actions = ActionsConfig(backend="kubernetes", command_timeout_seconds=10.0, ack_timeout_seconds=0.5,
                            kubernetes=KubernetesConfig(kubeconfig=str(sa_kubeconfig), node_selector="nvidia.com/gpu.present=true"))
    m = Migrator(actions, ep, state_dir=tmp_path / "state", runtime_dir=run_dir, node="node3",
                 signal_agent=lambda rec, sig: None, workers=concurrent.futures.ThreadPoolExecutor(2))
    try:
        trip = Trip(rule="xid", action="migrate", gpu=1, cause="xid:79", message="Xid 79 on GPU 1", values={})
        m.begin("k3", trip)
        assert rank.poll()[0].type == "migrate"  # the snapshot request left first, before any count
        wait_for(lambda: (m.tick([]), m.record.phase)[1] in ("refused", "drained"), timeout=30, what="breaker verdict")
        assert m.record.phase == "refused"
        n = node(clean, "node3")
        assert not n.spec.unschedulable and not n.spec.taints
        assert m.metric_counters()[("sentinel_breaker_refusals", (("backend", "kubernetes"),))] == 1
        # the threshold is exact: with 1 of 4 cordoned, node3 makes 2/4 = 50 %, which is not more than 50 %
        backend(clean, sa_kubeconfig, "node2", tmp_path / "node2").uncordon()
        m.begin("k4", trip)
        wait_for(lambda: (m.tick([]), m.record.phase)[1] in ("refused", "drained"), timeout=30, what="breaker verdict")
        assert m.record.phase == "drained" and m.record.scheduler_cordoned is True
        assert node(clean, "node3").spec.unschedulable is True
        # uncordon gives the node's place in the breaker's Lease back
        said = backend(clean, sa_kubeconfig, "node3", tmp_path / "node3").uncordon()
        assert "breaker lease entry removed" in said, said
    finally:
        m.close()
        ep.close()
        rank.close()


def test_a_burst_of_trips_never_cordons_more_than_the_fraction(clean, sa_kubeconfig, tmp_path):
    """3 of 4 nodes claim within ~0.25 s, five times, each on its own thread with its own client,
    against the real API server: the resourceVersion-checked Lease lets at most half through."""
    import random
    import threading

    rng = random.Random(24)
    selector = "nvidia.com/gpu.present=true"
    for rep in range(5):
        names = rng.sample(["node1", "node2", "node3", "node4"], 3)
        claimers = [backend(clean, sa_kubeconfig, n, tmp_path / f"{rep}-{n}", node_selector=selector) for n in names]
        start = threading.Barrier(len(claimers))
        delays = [rng.uniform(0, 0.25) for _ in claimers]

        def claim(b, delay):
            start.wait(10)
            time.sleep(delay)
            return b.claim_cordon(REASON)

        with concurrent.futures.ThreadPoolExecutor(len(claimers)) as pool:
            verdicts = list(pool.map(claim, claimers, delays))
        tainted = {n.metadata.name for n in clean.core().list_node(label_selector=selector).items
                   if any(t.key == "sentinel.dev/gpu-failure" for t in n.spec.taints or [])}
        won = {b.node for b, v in zip(claimers, verdicts) if v.allowed}
        assert len(tainted) <= 2, (rep, tainted, [v.why for v in verdicts])
        assert tainted == won, (rep, tainted, won)  # a refused node was never cordoned
        clean.reset_nodes()
        reset_breaker(clean)


def test_the_condition_message_carries_no_control_characters(clean, sa_kubeconfig, tmp_path):
    """The message can quote kernel text with a task name a user chose; `kubectl describe node`
    prints it to an operator's terminal: no escape sequence or line break gets through."""
    b = backend(clean, sa_kubeconfig, "node4", tmp_path)
    evil = CordonReason("kernel_log", -1, "kernel log: gpu_fallen_off_bus on node: \x1b]0;owned\x07\x1b[2J\nReady True", "r2")
    b.cordon(evil)
    try:
        c = condition(node(clean, "node4"))
        assert c.status == "False" and c.message.isprintable(), repr(c.message)
        assert c.message == "sentinel: node: kernel log: gpu_fallen_off_bus on node: ?]0;owned??[2J?Ready True"
    finally:
        b.uncordon()
