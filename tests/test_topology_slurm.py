"""Topology-aware hand-over through a real Slurm cluster with topology/tree and two leaf switches:
the batch script deploy/slurm/train.sbatch runs a job under `sentinel launch` on node1 + node2
(leaf A), with node3 (leaf B, first in the allocation's order) and node4 (leaf A) idle as spares.
The daemon's Migrator on node2 picks node4 — the spare under node2's own leaf — and the batch
script starts the agent there; the migration record and the metric say why and how far. And the
per-domain breaker refuses to drain most of one leaf while the fleet-wide one would allow it."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from sentinel.backends import make_backend
from sentinel.backends.base import BackendContext, CordonReason
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig
from sentinel.migration import Migrator
from sentinel.policy import Trip
from sentinel_tools.drill_slurm import SlurmCluster, missing

pytestmark = pytest.mark.needs_slurm
NODES = ("node1", "node2", "node3", "node4", "node5")
TOPOLOGY = """# two leaf switches under one spine
SwitchName=leafA Nodes=node1,node2,node4
SwitchName=leafB Nodes=node3,node5
SwitchName=spine Switches=leafA,leafB
"""
SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
TRIP = Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79 on GPU 0", values={})


@pytest.fixture(scope="module")
def tree_cluster():
    why = missing()
    if why:
        pytest.skip(f"a Slurm cluster needs {why}")
    root = Path(tempfile.mkdtemp(prefix="sentinel-slurm-topo-", dir="/tmp"))
    os.chmod(root, 0o755)
    cluster = SlurmCluster(root, nodes=NODES, topology=TOPOLOGY)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def migrator(cluster, node: str, root: Path) -> tuple[Migrator, DaemonEndpoint]:
    run_dir, state = root / node / "run", root / node / "state"
    run_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    ep = DaemonEndpoint(run_dir)
    m = Migrator(ActionsConfig(backend="slurm", command_timeout_seconds=10.0, ack_timeout_seconds=1.0), ep,
                 state_dir=state, runtime_dir=run_dir, node=node, signal_agent=lambda rec, sig: None,
                 workers=concurrent.futures.ThreadPoolExecutor(2))
    m.backend.ctx.env = cluster.env
    return m, ep



def submit_tree_job(c, tmp_path):
    """The batch script on node[1-4] of the tree (--switches=2: both leaves) with a stand-in agent
    that runs until <work>/STOP exists; returns (work, stop, job id). The agent's trailing words
    (ignored by bash -c) satisfy the script's check that the command names an elastic rendezvous
    (#23); node3 (leaf B) comes before node4 (leaf A) in the allocation's order, so "the first
    idle node" would be the far one."""
    work = tmp_path / "job"
    work.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(work, 0o755)
    stop = work / "STOP"
    agent = ["bash", "-c", f'while [ ! -e {stop} ]; do sleep 0.2; done', "agent", "--rdzv-backend=etcd-v2", "end"]
    env = {**c.env, "TRAIN_NODES": "2", "SENTINEL": f"{sys.executable} -m sentinel", "PYTHONPATH": str(REPO),
           "SENTINEL_RUNTIME_DIR": str(work / "%n" / "run"), "SENTINEL_STATE_DIR": str(work / "%n" / "state")}
    for n in NODES:
        (work / n / "run").mkdir(parents=True)
        (work / n / "state").mkdir(parents=True)
    r = subprocess.run(["sbatch", "--parsable", "--nodes=4", "--nodelist=node[1-4]", "--switches=2",
                        f"--output={work / 'job.out'}", f"--chdir={REPO}", str(SBATCH), *agent],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return work, stop, r.stdout.strip().split(";")[0]

def test_the_spare_under_the_departed_nodes_leaf_is_admitted(tree_cluster, tmp_path):
    c = tree_cluster
    # Slurm itself knows the tree
    shown = c.run("scontrol", "show", "topology").stdout
    assert "SwitchName=leafA" in shown and "SwitchName=leafB" in shown
    work, stop, job = submit_tree_job(c, tmp_path)
    m = ep = None
    try:
        for n in ("node1", "node2"):
            wait_for(lambda n=n: (work / n / "run" / "agent.pid").exists(), timeout=60,
                     what=f"the agent on {n}: {(work / 'job.out').read_text() if (work / 'job.out').exists() else ''}")
        assert not (work / "node3" / "run" / "agent.pid").exists()
        m, ep = migrator(c, "node2", work)
        m.backend.pidfile = work / "node2" / "run" / "agent.pid"
        m.begin("r1", TRIP)
        wait_for(lambda: (m.tick([]), m.record.spare)[1] is not None, timeout=60, what="the spare choice")
        assert m.record.spare["node"] == "node4" and m.record.spare["distance"] == "leaf"
        assert "leafA" in m.record.spare["why"] and "node3 (spine)" in m.record.spare["why"]
        assert "spare_chosen" in m.record.times
        assert m.metric_counters()[("sentinel_spare_choices", (("distance", "leaf"),))] == 1
        # the batch script started the agent on node4, not on node3
        wait_for(lambda: (work / "node4" / "run" / "agent.pid").exists(), timeout=60,
                 what=f"an agent on node4: {(work / 'job.out').read_text()}")
        assert not (work / "node3" / "run" / "agent.pid").exists()
        out = (work / "job.out").read_text()
        assert f"spare node4: Sentinel's choice (sentinel-spare=node4,node3;for=node2;job={job};distance=leaf)" in out, out
    finally:
        stop.write_text("")
        if m is not None:
            m.close()
            ep.close()
        c.run("scancel", job)
        wait_for(lambda: c.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() in ("", "COMPLETED", "CANCELLED"),
                 timeout=60, what="the job to end")
        c.reset_nodes()


def spare_records(c, job: str) -> dict[str, str]:
    """Every spare record Slurm holds for ``job``, by the failing node it is for: in the nodes'
    Comments, and in the job's own Comment (where they were written before #47)."""
    out = {}
    for line in c.run("sinfo", "-h", "-N", "-O", "NodeList:200,Comment:600").stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1].startswith("sentinel-spare=") and f";job={job};" in words[1]:
            out[words[1].split(";for=")[1].split(";")[0]] = words[1]
    comment = c.run("squeue", "-h", "-j", job, "-o", "%k").stdout.strip()
    if comment.startswith("sentinel-spare="):
        out[comment.split(" for=")[1].split()[0]] = comment
    return out


def test_two_nodes_of_one_job_failing_at_once_keep_both_spare_records_and_get_two_spares(tree_cluster, tmp_path):
    """#47 item 2: node1 and node2 of one job fail at the same moment and their daemons migrate at
    once. Each records its spare in its own node's Comment, so Slurm holds both (before, both wrote
    the job's Comment and only the last write was left), and the batch script acts on each record:
    an agent on node4 and one on node3, each Sentinel's choice for one failing node."""
    c = tree_cluster
    work, stop, job = submit_tree_job(c, tmp_path)
    pairs = []
    try:
        for n in ("node1", "node2"):
            wait_for(lambda n=n: (work / n / "run" / "agent.pid").exists(), timeout=60,
                     what=f"the agent on {n}: {(work / 'job.out').read_text() if (work / 'job.out').exists() else ''}")
        for n in ("node1", "node2"):
            m, ep = migrator(c, n, work)
            m.backend.pidfile = work / n / "run" / "agent.pid"
            pairs.append((m, ep))
        for i, (m, _) in enumerate(pairs):  # both at once: each spare call runs on its migrator's own workers
            m.begin(f"r{i}", TRIP)
        wait_for(lambda: all((m.tick([]), m.record.spare)[1] is not None for m, _ in pairs), timeout=60,
                 what="both spare choices")
        records = spare_records(c, job)
        assert set(records) == {"node1", "node2"}, records  # one record per failing node, both kept
        assert all(f";for={n};job={job};" in rec for n, rec in records.items()), records
        # the batch script acted on both: an agent on each spare, each one Sentinel's choice
        for n in ("node3", "node4"):
            wait_for(lambda n=n: (work / n / "run" / "agent.pid").exists(), timeout=60,
                     what=f"an agent on {n}: {(work / 'job.out').read_text()}")
        out = (work / "job.out").read_text()
        chosen = [line for line in out.splitlines() if "Sentinel's choice" in line]
        assert sorted(line.split("(", 1)[1].rstrip(")") for line in chosen) == sorted(records.values()), out
    finally:
        stop.write_text("")
        for m, ep in pairs:
            m.close()
            ep.close()
        c.run("scancel", job)
        wait_for(lambda: c.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() in ("", "COMPLETED", "CANCELLED"),
                 timeout=60, what="the job to end")
        for n in NODES:
            c.run("scontrol", "update", f"nodename={n}", "comment=")
        c.reset_nodes()


def test_the_per_domain_breaker_refuses_most_of_one_leaf(tree_cluster, tmp_path):
    c = tree_cluster
    state = tmp_path / "node1-state"
    state.mkdir()
    b = make_backend(ActionsConfig(backend="slurm"), BackendContext(node="node1", state_dir=state, runtime_dir=tmp_path,
                                                                    timeout=10.0, wall=time.time, env=c.env))
    b.cordon(CordonReason("xid", 0, "Xid 79 on GPU 0", "r0"))  # one of leaf A's three nodes, by Sentinel, just now
    m, ep = migrator(c, "node2", tmp_path)
    try:
        m.begin("r2", TRIP)
        done = ("refused", "cordoned", "drained")
        wait_for(lambda: (m.tick([]), m.record.phase)[1] in done, timeout=60, what="the breaker's verdict")
        # the fleet: 2 of 5 nodes (40 %) is allowed; leaf A: 2 of 3 (67 %) is not
        assert m.record.phase == "refused", m.record.notes
        assert any("2 of the 3 nodes of leaf domain leafA" in n and "page, do not drain" in n for n in m.record.notes)
        assert "DRAIN" not in c.node("node2")["State"]
        assert m.metric_counters()[("sentinel_migration_steps", (("step", "domain_breaker_leaf"),))] == 1
        # under leaf B the same fleet count drains: node3 is the first of its leaf
        m3, ep3 = migrator(c, "node3", tmp_path)
        try:
            m3.begin("r3", TRIP)
            wait_for(lambda: (m3.tick([]), m3.record.phase)[1] in done, timeout=60, what="the breaker's verdict")
            assert m3.record.phase in ("cordoned", "drained"), m3.record.notes
            assert "DRAIN" in c.node("node3")["State"]
        finally:
            m3.close()
            ep3.close()
    finally:
        m.close()
        ep.close()
        c.reset_nodes()
