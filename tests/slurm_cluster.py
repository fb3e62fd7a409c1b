"""The Slurm cluster fixture: one cluster per test session (the cluster itself lives in
sentinel_tools/drill_slurm.py, which the drill uses too; the Slurm drill test runs on this one).
Registered in conftest.py; a test that changes node states resets them (``reset_nodes``) after."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sentinel_tools.drill_slurm import SlurmCluster, missing


@pytest.fixture(scope="session")
def slurm():
    why = missing()
    if why:
        pytest.skip(f"a Slurm cluster needs {why}")
    root = Path(tempfile.mkdtemp(prefix="sentinel-slurm-", dir="/tmp"))
    os.chmod(root, 0o755)  # other users' scontrol reads slurm.conf
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
