"""The daemon's OCI image (scripts/build-image) as an operator runs it: Debian's podman starts it
with a read-only root file system in simulated mode, the real Prometheus scrapes it and evaluates
the shipped alert rules, and an Xid 79 injected through the simulated state trips the policy."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, wait_for
from oci_image import REF, VERSION, build_image, image_config, missing, podman_store
from prom_server import Prometheus
from sentinel_tools.ports import free_port

pytestmark = [pytest.mark.needs_root, pytest.mark.slow]


@pytest.fixture(scope="module")
def archive() -> Path:
    why = missing()
    if why:
        pytest.skip(f"the image test needs {why}")
    return build_image()


@pytest.fixture(scope="module")
def podman(archive):
    store = podman_store()
    try:
        assert store.load(archive) == REF
        yield store
    finally:
        store.close()


def test_the_manifests_name_the_image_the_build_makes(archive):
    made = image_config(archive)
    assert made["ref"] == REF == f"ghcr.io/sentinel-gpu/sentinel:{VERSION}"
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text()) if d]
    (container,) = docs[0]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == REF
    config = made["config"]["config"]
    assert config["Entrypoint"] == ["/usr/local/bin/sentinel"] and container["args"][0] == "run"
    assert config["Labels"]["org.opencontainers.image.version"] == VERSION
    assert len(made["layers"]) == 3  # Debian, the pinned Python dependencies, the wheel
    # the training job names the trainer image (scripts/build-image --trainer), and no image name
    # in the repository is one the build does not make
    job = REPO / "deploy" / "kubernetes" / "overlays" / "job-agents" / "training" / "training-job.yaml"
    jobs = [d for d in yaml.safe_load_all(job.read_text()) if d]
    images = {c["image"] for d in jobs if d["kind"] in ("Job", "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"ghcr.io/sentinel-gpu/sentinel-trainer:{VERSION}"}
    r = subprocess.run(["git", "grep", "-n", "-I", "-E", r"(image: *|ghcr\.io/|docker\.io/|quay\.io/)[a-z0-9.-]+/", "--", ".",
                        ":!tests/corpus"], cwd=REPO, capture_output=True, text=True, timeout=30)
    named = re.findall(r"((?:ghcr|docker|quay)\.io/[a-z0-9._/-]+)", r.stdout)
    assert named and set(named) <= {"ghcr.io/sentinel-gpu/sentinel", "ghcr.io/sentinel-gpu/sentinel-trainer"}, \
        sorted(set(named))


def test_the_image_carries_the_daemon_and_bcc_but_not_torch(podman):
    code = ("import importlib.util as u, sentinel, bcc, pynvml, prometheus_client, kubernetes; "
            "print(sentinel.__file__, u.find_spec('torch') is None)")
    r = podman("run", "--rm", "--read-only", "--ulimit", "nproc=4096:4096", "--ulimit", "nofile=1024:1024",
               "--network", "none", "--entrypoint", "python3", REF, "-c", code)
    path, no_torch = r.stdout.split()
    assert path == "/usr/local/lib/python3.11/dist-packages/sentinel/__init__.py" and no_torch == "True"


def test_podman_run_serves_metrics_and_an_xid_79_trips_and_fires_the_alert(podman, sim_state, tmp_path):
    from sentinel.sources import simulated

    run_dir, state_dir, prom_dir = tmp_path / "run", tmp_path / "state", tmp_path / "prom"
    for d in (run_dir, state_dir, prom_dir):
        d.mkdir()
    port = free_port()
    name = f"sntl-img-{secrets.token_hex(4)}"
    # as the DaemonSet runs it: read-only root file system; /run/sentinel and /var/lib/sentinel
    # from the host; the simulated GPUs' state file in place of NVML (a directory, so that the
    # inject's write-and-rename shows inside); no kernel log: other tests' lines are not ours
    podman.run(name, "--read-only", "--network", "host",
               "-v", f"{sim_state.parent}:/sim", "-v", f"{run_dir}:/run/sentinel", "-v", f"{state_dir}:/var/lib/sentinel",
               REF, "run", "--simulate", f"/sim/{sim_state.name}", "--node-name", "img-node",
               "--port", str(port), "--listen-address", "127.0.0.1", "--no-ebpf", "--no-kernel-log")
    prom = Prometheus(prom_dir, [f"127.0.0.1:{port}"], [REPO / "monitoring" / "alerts.yml"])
    try:
        def healthy():
            assert podman("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true", podman.logs(name)
            return {r["metric"]["gpu"] for r in prom.query('sentinel_gpu_health{job="sentinel"} == 0')} == {
                "0", "1", "2", "3"}

        wait_for(healthy, timeout=120, interval=0.5, what="Prometheus to scrape four healthy GPUs from the container")
        assert prom.firing("SentinelGPUFailed") == []

        simulated.inject(sim_state, 0, ["xid=79"])
        firing = wait_for(lambda: prom.firing("SentinelGPUFailed"), timeout=60, interval=0.5,
                          what="SentinelGPUFailed to fire")
        assert [(a["labels"]["gpu"], a["labels"]["instance"]) for a in firing] == [("0", f"127.0.0.1:{port}")]
        trips = prom.query('sentinel_policy_trips_total > 0')
        assert trips and all(t["metric"]["instance"] == f"127.0.0.1:{port}" for t in trips), trips
        xids = prom.query('sentinel_gpu_xid_errors_total{gpu="0",xid="79"}')
        assert [x["value"][1] for x in xids] == ["1"]
        # the trip's action, carried out from inside the container: the file backend's cordon
        # record on the host's state directory, and the node reported cordoned
        wait_for(lambda: prom.query("sentinel_node_cordoned == 1"), timeout=30, interval=0.5,
                 what="sentinel_node_cordoned == 1")
        assert wait_for(lambda: prom.firing("SentinelNodeCordoned"), timeout=30, interval=0.5,
                        what="SentinelNodeCordoned to fire")
        marker = json.loads((state_dir / "cordon.json").read_text())
        assert "79" in json.dumps(marker), marker
    finally:
        prom.stop()
        log = podman.logs(name)
        podman("rm", "-f", "-t", "10", name, check=False)
        print(log[-3000:])
