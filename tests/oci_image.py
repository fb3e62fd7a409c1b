"""The daemon's OCI image for tests: built (or found in the cache) by scripts/build-image, loaded
into a podman store of the test's own (a temporary --root/--runroot: nothing is left in the host's
store, and other suites' containers are never touched), run with Debian's podman and runc.
Everything a test starts is removed at the end, also on failure: containers (podman rm -f),
the store's mounts (podman system reset, then any mount left under it), the store itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
REPOSITORY = "ghcr.io/sentinel-gpu/sentinel"
REF = f"{REPOSITORY}:{VERSION}"


def missing() -> str:
    for tool, package in (("podman", "podman"), ("runc", "runc"), ("mmdebstrap", "mmdebstrap"), ("umoci", "umoci")):
        if shutil.which(tool) is None:
            return f"{tool} (Debian package {package}; scripts/setup-clusters installs it)"
    if os.geteuid() != 0:
        return "root (mmdebstrap, podman's store)"
    return ""


def build_image() -> Path:
    """The OCI archive of this checkout's image: scripts/build-image reuses the cached Debian and
    Python layers and rebuilds only what changed (the wheel's layer: seconds)."""
    r = subprocess.run(["bash", str(REPO / "scripts" / "build-image"), "--print-path"], capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, f"scripts/build-image failed:\n{r.stderr[-4000:]}"
    return Path(r.stdout.strip().splitlines()[-1])


def image_config(archive: Path) -> dict:
    """The image's config (entrypoint, env, labels), read from the OCI archive itself."""
    with tarfile.open(archive) as tar:
        def blob(digest: str) -> dict:
            return json.load(tar.extractfile("./blobs/" + digest.replace(":", "/")))

        index = json.load(tar.extractfile("./index.json"))
        manifest = blob(index["manifests"][0]["digest"])
        return {"ref": index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
                "config": blob(manifest["config"]["digest"]), "layers": manifest["layers"]}


class Podman:
    """podman with a store of its own (overlay on the test's directory, cgroupfs: no systemd here)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = ["podman", "--root", str(root / "storage"), "--runroot", str(root / "run"),
                     "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                     "--tmpdir", str(root / "tmp")]
        self.names: list[str] = []

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if check:
            assert r.returncode == 0, f"podman {' '.join(args)}: {r.stdout}{r.stderr}"
        return r

    def load(self, archive: Path) -> str:
        out = self("load", "-q", "-i", str(archive), timeout=600).stdout
        return out.strip().rpartition(" ")[2]

    def run(self, name: str, *args: str) -> str:
        """``podman run -d``; the limits are set at or below this host's hard ones: podman's defaults
        (nofile 1048576) are above them, and root here lacks CAP_SYS_RESOURCE to raise a hard limit."""
        import resource

        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        self.names.append(name)
        return self("run", "-d", "--name", name, "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096",
                    *args).stdout.strip()

    def logs(self, name: str) -> str:
        r = self("logs", name, check=False)
        return r.stdout + r.stderr

    def close(self) -> None:
        for name in self.names:
            self("rm", "-f", "-t", "10", name, check=False, timeout=60)
        self("system", "reset", "--force", check=False, timeout=120)
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if line.split()[4].startswith(str(self.root))]
        for mnt in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


def podman_store() -> Podman:
    root = Path(tempfile.mkdtemp(prefix="sentinel-podman-", dir="/var/tmp"))
    for sub in ("storage", "run", "tmp"):
        (root / sub).mkdir()
    return Podman(root)
