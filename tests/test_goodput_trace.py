"""`sentinel simulate goodput --trace`: replaying node fault traces (sentinel_tools/sim/trace.py).

Validation: a trace drawn from the simulator's own Poisson model replays to the Poisson path's
ETTR within Monte-Carlo error, and a burst of k simultaneous node faults loses exactly what the
model says for k (one restart; a replica pair in the burst falls back to disk; missing spares are
waited for). Plus the class table, its override, and every kind of bad input, named by line."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import REPO
from sentinel_tools.sim import trace
from sentinel_tools.sim.goodput import LABELS, STRATEGIES, Params, draw_failures, simulate

H = 3600.0


def write_trace(tmp_path, events, name="t.json", **top):
    path = tmp_path / name
    path.write_text(json.dumps({"time_unit": "hours", **top, "events": events}, indent=1))
    return str(path)


def burst(nodes, at, cls="power_supply", ends=None):
    """k faults at one instant, each node back after its own repair time."""
    out = [{"node": n, "time": at, "event": "fault_start", "class": cls} for n in nodes]
    out += [{"node": n, "time": (ends or {}).get(n, at + 100.0), "event": "fault_end"} for n in nodes]
    return sorted(out, key=lambda e: e["time"])


# -- validation: the Poisson model, replayed as a trace ---------------------------------------------
def test_a_trace_drawn_from_the_poisson_model_replays_to_its_ettr():
    # 64 job nodes + 64 spares, failures 5x Llama 3's rate, 12 h repairs: a pool that (nearly) never
    # runs dry, as the Poisson path's unlimited one; fixed intervals, so only the draws differ
    p = Params(gpus=512, days=60, rate_per_node_day=5 * 419 / 2048 / 54, repair_hours=12.0, interval_hours=0.5,
               memory_interval_steps=20)
    runs = 60
    rng = random.Random(7)
    poisson = {s: [simulate(p, s, d).ettr for d in (draw_failures(p, rng) for _ in range(runs))] for s in STRATEGIES}
    classes = trace.load_classes()
    replayed: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for i in range(runs):
        r = random.Random(1000 + i)
        events = trace.synthetic_events(p, 2 * p.nodes, r)
        tr = trace._check("synthetic", [(n + 1, e) for n, e in enumerate(events)], "hours", p.days * 24)
        tr.declared = [f"n{k:05d}" for k in range(2 * p.nodes)]
        q, lay, res = trace.replay(tr, p, classes, runs=1, seed=i)
        assert lay.job_nodes == 64 and lay.spare_nodes == 64 and not lay.unknown
        for s in STRATEGIES:
            replayed[s].append(res[s].ettr_mean)
    for s in STRATEGIES:
        a, b = poisson[s], replayed[s]
        se = math.sqrt(statistics.variance(a) / runs + statistics.variance(b) / runs)
        diff = statistics.fmean(a) - statistics.fmean(b)
        assert abs(diff) <= 4 * se + 1e-4, (s, statistics.fmean(a), statistics.fmean(b), se)


# -- validation: a burst of k simultaneous faults ----------------------------------------------------
def periodic_loss(p: Params, t: float, extra_wait: float = 0.0) -> float:
    """The model's loss for one restart at time t (periodic checkpoints, from the first principles:
    work since the last checkpoint + waiting for a node + the restart from disk)."""
    cycle = p.interval_hours + p.write_h()
    k, rem = divmod(t, cycle)
    done = k * p.interval_hours + min(rem, p.interval_hours)
    durable = math.floor(t / cycle) * p.interval_hours
    return (done - durable + extra_wait + p.restart_h("disk")) * p.gpus


@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_burst_of_k_simultaneous_node_faults_costs_one_restart(tmp_path, k):
    p = Params(gpus=16 * 8, days=30, interval_hours=0.5, spares=None)
    nodes = [f"node{i:02d}" for i in range(32)]  # 16 in the job, 16 spares
    path = write_trace(tmp_path, burst(nodes[:k], 100.3), nodes=nodes, duration=30 * 24)
    q, lay, res = trace.replay(trace.load_trace(path), p, trace.load_classes(), runs=1, strategies=("periodic",))
    assert len(lay.failures) == k and lay.waits == 0
    assert res["periodic"].lost_gpu_hours["power_supply"] == pytest.approx(periodic_loss(q, 100.3), rel=1e-9)


def test_a_burst_larger_than_the_free_spares_waits_for_the_repaired_nodes(tmp_path):
    p = Params(gpus=16 * 8, days=30, interval_hours=0.5)
    nodes = [f"node{i:02d}" for i in range(18)]  # 16 in the job, 2 spares
    hit = nodes[:4]
    ends = {hit[0]: 101.3, hit[1]: 102.3, hit[2]: 103.3, hit[3]: 104.3}
    path = write_trace(tmp_path, burst(hit, 100.3, ends=ends), nodes=nodes, duration=30 * 24)
    q, lay, res = trace.replay(trace.load_trace(path), p, trace.load_classes(), runs=1, strategies=("periodic",))
    assert lay.waits == 2  # the 3rd and 4th replacement are the first two repaired nodes
    assert res["periodic"].lost_gpu_hours["power_supply"] == pytest.approx(periodic_loss(q, 100.3, extra_wait=2.0),
                                                                           rel=1e-9)
    assert res["periodic"].waited_for_spare == 1.0


def test_two_replica_partners_in_one_burst_lose_the_memory_copy(tmp_path):
    # a slow filesystem (4 GB per GPU at 0.2 GB/s per node): the disk copy lags the memory tier's
    p = Params(gpus=16 * 8, days=30, memory_interval_steps=10, placement="cross_domain", domain_nodes=4,
               state_gb_per_gpu=4.0, node_write_gbps=0.2)
    nodes = [f"node{i:02d}" for i in range(32)]
    classes = trace.load_classes()
    apart = write_trace(tmp_path, burst([nodes[0], nodes[1]], 100.3), "apart.json", nodes=nodes, duration=720)
    pair = write_trace(tmp_path, burst([nodes[0], nodes[4]], 100.3), "pair.json", nodes=nodes, duration=720)  # 4 = partner of 0
    _, _, a = trace.replay(trace.load_trace(apart), p, classes, runs=1, strategies=("sentinel_memory",))
    _, _, b = trace.replay(trace.load_trace(pair), p, classes, runs=1, strategies=("sentinel_memory",))
    assert a["sentinel_memory"].double_failures == 0
    assert b["sentinel_memory"].double_failures == 1
    # the pair restarts from disk: more lost than the same burst on two unrelated nodes
    assert sum(b["sentinel_memory"].lost_gpu_hours.values()) > sum(a["sentinel_memory"].lost_gpu_hours.values())
    same = replace(p, placement="adjacent")
    _, _, c = trace.replay(trace.load_trace(apart), same, classes, runs=1, strategies=("sentinel_memory",))
    assert c["sentinel_memory"].double_failures == 1  # adjacent placement: nodes 0 and 1 are partners


# -- the class table ------------------------------------------------------------------------------------
def test_classes_map_by_name_then_glob_and_unknown_ones_are_counted_not_dropped(tmp_path):
    classes = trace.load_classes()
    assert classes.lookup("GPU HBM3 Memory").name == "gpu_hbm3_memory"
    assert classes.lookup("Xid 79: GPU has fallen off the bus").kind == "sudden"
    assert classes.lookup("ECC over threshold").kind == "predicted"
    assert classes.lookup("PCIe width low (x8)").kind == "predicted"
    assert classes.lookup("Suspect machine offline").name == "suspect_machine_offline"
    assert classes.lookup("NCCL watchdog timeout").kind == "process"
    assert classes.lookup("planned maintenance while idle").kind == "none"
    assert classes.lookup("gremlins") is None
    nodes = [f"n{i}" for i in range(8)]
    ev = burst(["n0"], 10.0, cls="gremlins") + [{"node": "n1", "time": 200.0, "event": "fault_start", "class": "gremlins"},
                                                 {"node": "n1", "time": 300.0, "event": "fault_end"}]
    path = write_trace(tmp_path, sorted(ev, key=lambda e: e["time"]), nodes=nodes)
    p = Params(gpus=4 * 8, days=30)
    _, lay, res = trace.replay(trace.load_trace(path), p, classes, runs=2)
    assert lay.unknown == {"gremlins": 2} and len(lay.failures) == 2  # replayed as sudden, not dropped
    assert all(s.lost_gpu_hours.get("gremlins", 0) > 0 for s in res.values())


def test_an_override_file_replaces_a_class_and_is_printed(tmp_path):
    override = tmp_path / "mine.toml"
    override.write_text('[classes.gremlins]\nkind = "none"\n\n[classes.faulty_gpu]\nkind = "predicted"\npredictable = 1.0\n'
                        'match = ["gpu_fault*"]\n')
    classes = trace.load_classes(str(override))
    assert classes.lookup("gremlins").kind == "none"
    assert classes.lookup("faulty_gpu").predictable == 1.0
    assert sum(r.name == "faulty_gpu" for r in classes.rules) == 1
    assert f"<- {override}" in classes.text()
    path = write_trace(tmp_path, burst(["n0"], 10.0, cls="gremlins"), nodes=[f"n{i}" for i in range(8)])
    _, lay, res = trace.replay(trace.load_trace(path), Params(gpus=32, days=30), classes, runs=1)
    assert lay.not_interruptions == 1 and not lay.failures and not lay.unknown
    bad = tmp_path / "bad.toml"
    bad.write_text('[classes.x]\nkind = "explodes"\n')
    with pytest.raises(trace.TraceError, match=r"bad.toml: \[classes.x\]: kind must be one of"):
        trace.load_classes(str(bad))


# -- the circuit breaker ---------------------------------------------------------------------------------
def test_a_burst_of_predicted_faults_meets_the_breaker(tmp_path):
    nodes = [f"n{i}" for i in range(8)]  # 4 in the job, 4 spares
    ev = []
    for i, n in enumerate(nodes[:4]):
        ev += [{"node": n, "time": 10.0 + i, "event": "fault_start", "class": "row remapping failure"},
               {"node": n, "time": 500.0 + i, "event": "fault_end"}]
    path = write_trace(tmp_path, sorted(ev, key=lambda e: e["time"]), nodes=nodes, duration=720)
    p = Params(gpus=32, days=30, lead_mean_hours=0.25, breaker_max_fraction=0.25, breaker_window_seconds=24 * H)
    _, _, res = trace.replay(trace.load_trace(path), p, trace.load_classes(), runs=20)
    assert res["sentinel"].breaker_refusals > 0 and res["sentinel"].migrations > 0
    assert res["periodic"].breaker_refusals == 0 == res["async"].breaker_refusals
    _, _, free = trace.replay(trace.load_trace(path), replace(p, breaker_max_fraction=1.0), trace.load_classes(), runs=20)
    assert free["sentinel"].breaker_refusals == 0
    assert free["sentinel"].migrations > res["sentinel"].migrations


# -- layout ------------------------------------------------------------------------------------------------
def test_a_job_larger_than_the_trace_repeats_it_over_disjoint_shifted_copies(tmp_path):
    nodes = [f"n{i}" for i in range(4)]
    path = write_trace(tmp_path, burst(["n0"], 600.0, cls="gpu lost", ends={"n0": 700.0}), nodes=nodes, duration=720)
    _, lay, _ = trace.replay(trace.load_trace(path), Params(gpus=10 * 8, days=30), trace.load_classes(), runs=1,
                             strategies=("async",))
    assert lay.copies == 3 and lay.job_nodes == 10 and lay.spare_nodes == 2
    # copy k is shifted by k/3 of 720 h: the fault of copy 1 wraps (600 + 240 -> 120), copy 2 -> 600 + 480 - 720
    assert sorted(round(e.time, 6) for e, *_ in lay.failures) == [120.0, 360.0, 600.0]


# -- bad input, named by line -------------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    ('[{"node": "a", "time_hours": 1, "event": "fault_begin", "class": "x"}]', r"t.json:1: unknown event type 'fault_begin'"),
    ('[\n{"node": "a", "time_hours": 1, "event": "fault_end", "class": "x"}\n]', r"t.json:2: fault_end for node a without a fault_start"),
    ('[\n{"node": "a", "time_hours": 5, "event": "fault_start", "class": "x"},\n'
     '{"node": "b", "time_hours": 4, "event": "fault_start", "class": "x"}\n]', r"t.json:3: time goes backwards"),
    ('[\n{"node": "a", "time": 5, "event": "fault_start", "class": "x"}\n]', r"t.json:2: the time unit is missing"),
    ('{"events": []}', r"time_unit missing"),
    ('[\n{"node": "a", "time_days": 1, "event": "fault_start", "class": "x"},\n'
     '{"node": "a", "time_days": 2, "event": "fault_start", "class": "x"}\n]', r"t.json:3: node a starts a fault while its fault of line 2"),
    # the top-level keys: a NaN duration, an infinite, fractional, boolean or huge node count, a duration that is text
    ('{"time_unit": "days", "duration": NaN, "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: duration must be a finite number, not nan"),
    ('{"time_unit": "days", "duration": "x", "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: duration must be a finite number, not 'x'"),
    ('{"time_unit": "days", "nodes": Infinity, "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: nodes must be a count"),
    ('{"time_unit": "days", "nodes": 2.7, "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: nodes must be a count"),
    ('{"time_unit": "days", "nodes": true, "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: nodes must be a count"),
    ('{"time_unit": "days", "nodes": 1000000000000, "events": [{"node": "a", "time": 1, "event": "fault_start", "class": "x"}]}', r"t.json: nodes must be a count"),
])
def test_bad_json_traces_are_refused_naming_the_line(tmp_path, body, message):
    (tmp_path / "t.json").write_text(body)
    with pytest.raises(trace.TraceError, match=message):
        trace.load_trace(str(tmp_path / "t.json"))


@pytest.mark.parametrize("body, message", [
    ("node,time_days,event,class\na,1,fault_start,x\na,0.5,fault_end,x\n", r"t.csv:3: time goes backwards"),
    ("node,time,event,class\na,1,fault_start,x\n", r"t.csv:2: the time unit is missing"),
    ("# time_unit: weeks\nnode,time,event,class\na,1,fault_start,x\n", r"t.csv:3: unknown time unit 'weeks'"),
    ("node,time_days,event,class\na,1,broke,x\n", r"t.csv:2: unknown event type 'broke'"),
    ("node,time_days,event,class\nb,1,fault_end,x\n", r"t.csv:2: fault_end for node b without a fault_start"),
    ("# duration: nan\nnode,time_days,event,class\na,1,fault_start,x\n", r"t.csv: duration must be a finite number"),
    ("# nodes: 1.5\nnode,time_days,event,class\na,1,fault_start,x\n", r"t.csv: nodes must be a count"),
])
def test_bad_csv_traces_are_refused_naming_the_line(tmp_path, body, message):
    (tmp_path / "t.csv").write_text(body)
    with pytest.raises(trace.TraceError, match=message):
        trace.load_trace(str(tmp_path / "t.csv"))


def test_csv_and_json_of_one_trace_replay_the_same(tmp_path):
    rows = [("n1", 1.0, "fault_start", "GPU fell off the bus", "Xid 79"), ("n3", 1.0, "fault_start", "PSU", ""),
            ("n1", 3.0, "fault_end", "", ""), ("n3", 4.5, "fault_end", "", "")]
    (tmp_path / "t.csv").write_text("# time_unit: days\n# nodes: 6\nnode,time,event,class,description\n"
                                    + "".join(f"{n},{t},{e},{c},{d}\n" for n, t, e, c, d in rows))
    write_trace(tmp_path, [{"node": n, "time_days": t, "event": e, "class": c, "description": d} for n, t, e, c, d in rows],
                nodes=6)
    a, b = trace.load_trace(str(tmp_path / "t.csv")), trace.load_trace(str(tmp_path / "t.json"))
    assert [(e.node, e.time, e.event, e.cls) for e in a.events] == [(e.node, e.time, e.event, e.cls) for e in b.events]
    assert len(a.nodes) == len(b.nodes) == 6 and a.duration == b.duration == 4.5 * 24
    p = Params(gpus=32, days=30)
    ra = trace.replay(a, p, trace.load_classes(), runs=3)[2]
    rb = trace.replay(b, p, trace.load_classes(), runs=3)[2]
    assert {s: r.ettr_mean for s, r in ra.items()} == {s: r.ettr_mean for s, r in rb.items()}


# -- the command -------------------------------------------------------------------------------------------
def test_the_command_prints_every_strategy_and_cause_for_a_400_node_year(tmp_path):
    p = Params(gpus=3200, days=365)
    events = trace.synthetic_events(p, 400, random.Random(3))
    path = write_trace(tmp_path, events, nodes=[f"n{i:05d}" for i in range(400)], duration=365 * 24)
    r = subprocess.run([sys.executable, "-m", "sentinel", "simulate", "goodput", "--trace", path, "--measured",
                        str(REPO / "docs" / "measured.json"), "--gpus", "2048", "--runs", "10"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for s in STRATEGIES:
        assert LABELS[s] in out
    for needed in ("class table", "unknown classes: 0", "hand-overs", "double fail", "breaker ref", "lost GPU-hours by cause",
                   "400 nodes", "job 2,048 GPUs = 256 nodes; spare pool 144 nodes"):
        assert needed in out, needed
    bad = tmp_path / "bad.csv"
    bad.write_text("node,time,event,class\na,1,fault_start,x\n")
    r = subprocess.run([sys.executable, "-m", "sentinel", "simulate", "goodput", "--trace", str(bad)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "bad.csv:2: the time unit is missing" in r.stderr
