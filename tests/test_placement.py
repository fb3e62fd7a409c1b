"""The placement simulator: bytes per tier, step time, far spares and replica placement."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sentinel_tools.sim import goodput, placement
from sentinel_tools.sim.placement import Cluster


def test_a_spare_outside_the_domain_moves_bytes_onto_the_scale_out_network():
    c = Cluster()
    near, leaf, core = (placement.step_for_tier(c, t) for t in ("nvlink", "leaf", "core"))
    assert near.bytes_per_tier["leaf"] == near.bytes_per_tier["spine"] == near.bytes_per_tier["core"] == 0
    assert leaf.bytes_per_tier["leaf"] > 0 and core.bytes_per_tier["core"] == leaf.bytes_per_tier["leaf"]
    # the same bytes in total, only where they travel changes
    assert sum(near.bytes_per_tier.values()) == pytest.approx(sum(leaf.bytes_per_tier.values()))
    assert near.step_seconds < leaf.step_seconds < core.step_seconds
    # 900 GB/s vs 50 GB/s per GPU: the ring is 18x slower at its slowest edge
    assert leaf.comm_seconds / near.comm_seconds == pytest.approx(900 / 50)


def test_overlap_hides_communication_up_to_the_compute_time():
    c = Cluster(overlap=1.0)
    assert placement.step_for_tier(c, "core").step_seconds == c.compute_seconds


def test_nearest_spare_keeps_the_job_faster_than_a_random_one():
    c = Cluster(gpus=4096)
    p = goodput.Params(gpus=4096, days=10)
    near = placement.spare_monte_carlo(c, p, "nearest", runs=4, seed=1)
    rand = placement.spare_monte_carlo(c, p, "random", runs=4, seed=1)
    assert near.share_by_tier["nvlink"] > 0.9 > rand.share_by_tier["nvlink"]
    assert near.ettr_factor > rand.ettr_factor
    assert 0 < rand.ettr_factor <= 1


def test_replicas_in_another_rack():
    ring, plan = placement.same_rack_share_of_plans(Cluster(gpus=2048))
    assert plan == 0.0 and ring > 0.9
    p = goodput.Params(gpus=2048, domain_nodes=16)
    from dataclasses import replace

    assert goodput.double_failure_probability(replace(p, placement="adjacent")) > 100 * goodput.double_failure_probability(
        replace(p, placement="cross_domain"))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="spares_per_domain"):
        Cluster(spares_per_domain=18)
    with pytest.raises(ValueError, match="nvlink_gbps"):
        Cluster(nvlink_gbps=float("nan"))


def test_cli_prints_the_side_by_side_table():
    r = subprocess.run([sys.executable, "-m", "sentinel", "simulate", "placement", "--gpus", "2048", "--days", "5",
                        "--runs", "2", "--ettr-runs", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in ("spare: nearest (Sentinel)", "spare: first waiting (random)", "replica: another rack (Sentinel)",
                "replica: same rack ((n+1) mod N)", "nvlink_gbps", "<- NVLink 5"):
        assert row in r.stdout
    bad = subprocess.run([sys.executable, "-m", "sentinel", "simulate", "placement", "--spares-per-domain", "30"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "spares_per_domain" in bad.stderr


def test_at_16384_gpus_nearest_spare_and_cross_rack_replicas_win():
    c = Cluster(gpus=16384)
    p = goodput.Params(gpus=16384, days=30)
    near = placement.spare_monte_carlo(c, p, "nearest", runs=3, seed=0)
    rand = placement.spare_monte_carlo(c, p, "random", runs=3, seed=0)
    assert near.ettr_factor > rand.ettr_factor and near.share_by_tier["nvlink"] > rand.share_by_tier["nvlink"]
    ring, plan = placement.same_rack_share_of_plans(c)
    assert plan == 0.0 and ring > 0.9  # 4,096 nodes: Sentinel's plan keeps no replica in its holder's rack
