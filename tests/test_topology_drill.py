"""`sentinel drill --topology FILE`: the near spare is admitted while a far one waits first in
line, the timeline says how far and why, and the memory tier keeps every replica outside its
holder's rack — before the fault and after the spare joined."""

from __future__ import annotations

import json
import re
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

    # the memory tier's placement, agreed by all ranks and printed by rank 0 at each (re)start
    placements = result["replica_placement"]
    assert len(placements) >= 2, placements
    for p in (placements[0], placements[-1]):
        for line in p["placement"]:
            m = re.match(r"(\S+) \((rack=\S+),power=\?\) -> replica on (\S+) \((rack=\S+),power=\?, (\S+)\)", line)
            assert m, line
            assert m.group(2) != m.group(4) and m.group(5) == "leaf", line  # another rack, the same leaf
    assert {re.match(r"(\S+)", line).group(1) for line in placements[-1]["placement"]} == {"node0", "spare1"}
