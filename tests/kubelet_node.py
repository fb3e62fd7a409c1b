"""A real Kubernetes node for tests: Debian's containerd (CRI) and runc, the CNI bridge plugin, and
a kubelet built from Debian's `kubernetes` source package (scripts/setup-clusters), registered with
a kube-apiserver of its own that runs the ServiceAccount admission plugin, with the
kube-controller-manager (DaemonSet, ServiceAccount token controllers) and the kube-scheduler built
from the same tree. The sandbox ("pause") image is compiled from the same tree's build/pause.

What differs from a production node, and why (each is named in docs/known-limits.md):
* no kube-proxy: nothing routes the `kubernetes` Service's virtual IP, so the apiserver listens on
  the pod bridge's address and the test's overlay points the pod's in-cluster config there
  (KUBERNETES_SERVICE_HOST/PORT);
* the kubelet authenticates with the admin token (no TLS bootstrap, no Node authorizer);
* the kubelet's own cgroup tree is off (--cgroups-per-qos=false; cgroup v1, no systemd here);
* oom_score_adj is clamped to containerd's (restrict_oom_score_adj): root here has no
  CAP_SYS_RESOURCE, and runc fails to start a container asking for a negative one.

Every process is started here and stopped by pid; the pods are deleted through the API first (so
the kubelet stops them and CNI removes their network namespaces), then what is left (tasks, shims,
mounts under the node's directory, the bridge, the kernel settings the kubelet changes) is removed
or restored, also on failure."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kube_cluster import KUBE_APISERVER, KubeCluster, KubeUnavailable
from sentinel_tools.drill_slurm import stop_groups
from sentinel_tools.ports import free_ports

BIN = KUBE_APISERVER.parent
CACHE = BIN.parent  # /var/cache/sentinel-ci/kube
PAUSE_REF = "registry.k8s.io/pause:3.4"  # build/pause/Makefile's TAG in the same source tree
# the kubelet sets these on start (its protect-kernel-defaults list); the node restores them after
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def missing() -> str:
    for name in ("kubelet", "kube-controller-manager", "kube-scheduler"):
        if not (BIN / name).exists():
            return f"{BIN / name} (bash scripts/setup-clusters builds it, once)"
    if not (CACHE / "pause.oci.tar").exists():
        return f"{CACHE / 'pause.oci.tar'} (bash scripts/setup-clusters builds it, once)"
    for tool, package in (("containerd", "containerd"), ("ctr", "containerd"), ("runc", "runc"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {package})"
    if not Path("/usr/lib/cni/bridge").exists():
        return "/usr/lib/cni/bridge (Debian package containernetworking-plugins)"
    return ""


def free_subnet() -> str:
    """A /24 in 10.200.0.0/13 that no interface or route of the host uses (another suite's node)."""
    used = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    while True:
        net = f"10.{random.randint(200, 207)}.{random.randint(0, 255)}"
        if f"{net}." not in used:
            return net


class KubeletNode:
    def __init__(self) -> None:
        self.id = secrets.token_hex(3)
        self.root = Path(tempfile.mkdtemp(prefix="sentinel-kubelet-", dir="/tmp"))
        self.name = f"sntl-node-{self.id}"
        self.bridge = f"sntlkb{self.id}"
        net = free_subnet()
        self.subnet, self.gateway = f"{net}.0/24", f"{net}.1"
        self.sock = self.root / "containerd.sock"
        self.procs: dict[str, subprocess.Popen] = {}
        self.sysctls = {k: Path("/proc/sys", k).read_text() for k in KUBELET_SYSCTLS if Path("/proc/sys", k).exists()}
        self.cluster: KubeCluster | None = None
        self.pods: set[str] = set()  # <namespace>_<name>_<uid>: the kubelet's /var/log/pods/ entries

    # -- bring-up ---------------------------------------------------------------------------------
    def start(self, images: list[Path]) -> None:
        self.run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        self.run(["ip", "link", "set", self.bridge, "up"])
        self.start_control_plane()
        self.start_containerd()
        for archive in [CACHE / "pause.oci.tar", *images]:
            self.ctr("images", "import", "--all-platforms", str(archive), timeout=600)
        self.start_kubelet()

    def start_control_plane(self) -> None:
        audit = self.root / "audit-policy.yaml"
        audit.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n"
                         "  - level: Metadata\n    verbs: [patch, update]\n    resources: [{group: '', resources: [nodes, nodes/status]}]\n"
                         "  - level: None\n")
        cluster = KubeCluster(self.root / "cluster", address=self.gateway, nodes=(), apiserver_args=(
            f"--audit-policy-file={audit}", f"--audit-log-path={self.root / 'audit.log'}"))
        cluster.root.mkdir()
        self.cluster = cluster
        cluster.start()
        r = cluster.root
        common = [f"--kubeconfig={cluster.kubeconfig}", "--leader-elect=false", "--port=0", "--secure-port=0"]
        cluster.procs["kube-controller-manager"] = subprocess.Popen(
            [str(BIN / "kube-controller-manager"), *common, "--controllers=daemonset,serviceaccount-token,serviceaccount",
             f"--service-account-private-key-file={r / 'sa.key'}", f"--root-ca-file={r / 'certs' / 'apiserver.crt'}",
             "--use-service-account-credentials=false"],
            stdout=open(r / "controller-manager.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        cluster.procs["kube-scheduler"] = subprocess.Popen(
            [str(BIN / "kube-scheduler"), *common], stdout=open(r / "scheduler.log", "ab"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def start_containerd(self) -> None:
        d = self.root
        (d / "cni").mkdir()
        (d / "cni" / "10-sentinel.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": f"sntl-{self.id}", "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet, "gateway": self.gateway}]],
                          "dataDir": str(d / "cni-ipam")}}]}))
        stream_port, = free_ports(1)
        (d / "containerd.toml").write_text(f"""version = 2
root = "{d / 'containerd-root'}"
state = "{d / 'containerd-state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'containerd-opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_REF}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "{stream_port}"
  # no CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj (the sandbox asks -998, a critical
  # pod -997); clamp them to containerd's own instead
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "{d / 'runc'}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{d / 'cni'}"
""")
        self.procs["containerd"] = subprocess.Popen(
            ["containerd", "--config", str(d / "containerd.toml")], stdout=open(d / "containerd.log", "ab"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(lambda: self.ctr("version", check=False).returncode == 0, 60, "containerd's socket")

    def start_kubelet(self) -> None:
        d, cluster = self.root, self.cluster
        port, healthz = free_ports(2)
        self.procs["kubelet"] = subprocess.Popen(
            [str(BIN / "kubelet"), f"--kubeconfig={cluster.kubeconfig}", f"--hostname-override={self.name}",
             f"--node-ip={self.gateway}", "--container-runtime=remote",
             f"--container-runtime-endpoint=unix://{self.sock}", f"--root-dir={d / 'kubelet'}",
             f"--cert-dir={d / 'kubelet-pki'}", f"--volume-plugin-dir={d / 'volume-plugins'}",
             "--cgroup-driver=cgroupfs", "--cgroups-per-qos=false", "--enforce-node-allocatable=",
             "--fail-swap-on=false", "--address=127.0.0.1", f"--port={port}", "--read-only-port=0",
             "--healthz-bind-address=127.0.0.1", f"--healthz-port={healthz}",
             "--node-labels=nvidia.com/gpu.present=true", "--make-iptables-util-chains=false",
             # the disk is shared: neither image garbage collection nor eviction acts on it
             "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
             "--eviction-hard=memory.available<1Mi", "--node-status-update-frequency=2s",
             "--anonymous-auth=false", "--authorization-mode=AlwaysAllow", "--v=3"],
            stdout=open(d / "kubelet.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.wait(self.node_ready, 180, f"Node {self.name} Ready")

    # -- helpers ------------------------------------------------------------------------------------
    def run(self, argv: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise KubeUnavailable(f"{' '.join(argv)}: {r.stdout}{r.stderr}")
        return r

    def ctr(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return self.run(["ctr", "--address", str(self.sock), "--namespace", "k8s.io", *args], timeout=timeout, check=check)

    def node_ready(self) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            node = self.cluster.core().read_node(self.name)
        except ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    def wait(self, predicate, timeout: float, what: str):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise KubeUnavailable(f"{name} exited ({p.returncode}): {self.logs()}")
            got = predicate()
            if got:
                return got
            time.sleep(0.5)
        raise KubeUnavailable(f"timed out after {timeout:.0f} s waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for path in (self.root / "kubelet.log", self.root / "containerd.log",
                     self.root / "cluster" / "controller-manager.log", self.root / "cluster" / "scheduler.log"):
            try:
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    # -- teardown -----------------------------------------------------------------------------------
    def stop(self) -> None:
        try:
            self.delete_pods()
        finally:
            stop_groups([self.procs.pop("kubelet")] if "kubelet" in self.procs else [], grace=20)
            self.remove_containers()
            stop_groups(list(self.procs.values()), grace=15)
            if self.cluster is not None:
                self.cluster.stop()
            self.kill_shims()
            self.unmount_all()
            self.remove_host_leftovers()
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            for key, value in self.sysctls.items():
                try:
                    Path("/proc/sys", key).write_text(value)
                except OSError:
                    pass
            shutil.rmtree(self.root, ignore_errors=True)

    def delete_pods(self) -> None:
        """Every namespace's pods deleted through the API while the kubelet runs: it stops their
        containers and CNI removes their network namespaces and addresses."""
        if self.cluster is None or "kubelet" not in self.procs or self.procs["kubelet"].poll() is not None:
            return
        from kubernetes import client

        apps, core = client.AppsV1Api(self.cluster.api), self.cluster.core()
        for ds in apps.list_daemon_set_for_all_namespaces().items:
            apps.delete_namespaced_daemon_set(ds.metadata.name, ds.metadata.namespace)
        for pod in core.list_pod_for_all_namespaces().items:
            self.pods.add(f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid}")
            core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=10)
        end = time.monotonic() + 90
        while time.monotonic() < end and core.list_pod_for_all_namespaces().items:
            time.sleep(0.5)
        end = time.monotonic() + 60  # the sandboxes too (the kubelet removes them after the pods)
        while time.monotonic() < end and self.ctr("tasks", "ls", "-q", check=False).stdout.strip():
            time.sleep(0.5)

    def remove_containers(self) -> None:
        if "containerd" not in self.procs or self.procs["containerd"].poll() is not None:
            return
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
            self.ctr("tasks", "delete", "-f", task, check=False)
        for container in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "delete", container, check=False)

    def kill_shims(self) -> None:
        """containerd-shim-runc-v2 processes of this node's containerd (their command line names its
        socket), by pid."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(self.sock).encode() in argv:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass

    def remove_host_leftovers(self) -> None:
        """What the kubelet, containerd and CNI write outside the node's directory, at paths they
        fix: this node's pod log directories and CNI result cache entries; then, unless another
        kubelet or containerd runs, the kubelet's device-plugin files and the directories left empty."""
        for pod in self.pods:
            shutil.rmtree(Path("/var/log/pods") / pod, ignore_errors=True)
        for cached in Path("/var/lib/cni/results").glob(f"sntl-{self.id}-*"):
            cached.unlink(missing_ok=True)
        if any(_exe_name(p) in ("kubelet", "containerd") for p in os.listdir("/proc") if p.isdigit()):
            return  # another suite's node runs: what is left at the shared paths may be its own
        for name in ("kubelet.sock", "DEPRECATION"):
            Path("/var/lib/kubelet/device-plugins", name).unlink(missing_ok=True)
        for top in ("/var/lib/kubelet", "/run/containerd"):  # only these two programs write there
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                try:
                    os.rmdir(dirpath)  # only if empty
                except OSError:
                    pass
        for shared in [Path("/var/lib/cni/results"), Path("/var/log/pods"),
                       *(h / "k8s.io" for h in Path("/sys/fs/cgroup").iterdir())]:  # runc's parent cgroup
            try:
                shared.rmdir()  # only if empty: other programs write there too
            except OSError:
                pass

    def unmount_all(self) -> None:
        for _ in range(3):
            mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                      if line.split()[4].startswith(str(self.root))]
            if not mounts:
                return
            for mnt in sorted(mounts, key=len, reverse=True):
                subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)


def _exe_name(pid: str) -> str:
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")).name
    except OSError:
        return ""


def start_node(images: list[Path]) -> KubeletNode:
    node = KubeletNode()
    try:
        node.start(images)
        return node
    except BaseException:
        node.stop()
        raise
