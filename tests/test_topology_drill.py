"""`sentinel drill --topology FILE`: the near spare is admitted while a far one waits first in
line, and the timeline says how far and why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]

TOPOLOGY = """
[nodes.node0]
switches = ["leafA", "spine1"]
rack = "rack0"
[nodes.node1]
switches = ["leafA", "spine1"]
rack = "rack1"
[nodes.spare0]
switches = ["leafB", "spine1"]
rack = "rack2"
[nodes.spare1]
switches = ["leafA", "spine1"]
rack = "rack3"
"""


def test_drill_admits_the_spare_under_the_failed_nodes_leaf(tmp_path):
    topo = tmp_path / "topology.toml"
    topo.write_text(TOPOLOGY)
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--json", "--spares", "2", "--topology", str(topo)],
                       capture_output=True, text=True, timeout=400, cwd=REPO)
    assert r.stdout.strip().startswith("{"), r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert r.returncode == 0 and result["ok"], result
    # spare0 (leaf B) is first in line; the failed node1 is under leaf A, as spare1 is
    assert result["spare_choice"]["node"] == "spare1" and result["spare_choice"]["distance"] == "leaf"
    assert "spare1" in result["final_nodes"] and "spare0" not in result["final_nodes"]
    chosen = next(e for e in result["timeline"] if e["stage"] == "spare chosen")
    assert chosen["distance"] == "leaf" and "leafA" in chosen["why"] and "spare0 (spine)" in chosen["why"]
    admitted = next(e for e in result["timeline"] if e["stage"] == "spare admitted")
    assert admitted["node"] == "spare1" and admitted["distance"] == "leaf"
