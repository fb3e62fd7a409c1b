"""The daemon and its tools never import torch: import every sentinel and sentinel_tools module and run a daemon in one process."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = r"""
import importlib, pkgutil, sys, tempfile, os
import sentinel, sentinel_tools
for pkg in (sentinel, sentinel_tools):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name != "sentinel.__main__":
            importlib.import_module(m.name)
from sentinel import config
from sentinel.builder import build_daemon
from sentinel.sources import simulated
d = tempfile.mkdtemp()
simulated.write_state(os.path.join(d, "s.json"), simulated.healthy_state(2))
cfg = config.Config()
import dataclasses
cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon, runtime_dir=d + "/run", state_dir=d + "/state"),
                          metrics=dataclasses.replace(cfg.metrics, port=0, listen_address="127.0.0.1"))
daemon = build_daemon(cfg, simulate=os.path.join(d, "s.json"), no_ebpf=True)
daemon.start(); daemon.poll_once(); daemon.close()
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""


def test_daemon_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
