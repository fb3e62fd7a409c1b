"""The Slurm cluster fixture (the cluster itself lives in sentinel_tools/drill_slurm.py, which the
drill uses too)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sentinel_tools.drill_slurm import SlurmCluster, missing


@pytest.fixture(scope="module")
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
