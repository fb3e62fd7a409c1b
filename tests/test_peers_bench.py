"""bench/peers.py: its accounting on made-up step logs (what a fault cost), its pins, and its smoke
run for real (Sentinel's drill and torch elastic + DCP, the kill at the same step): this is the
bench's smoke in the suite (bench_smoke.OWN_TEST)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from bench_smoke import REPO, run_smoke

sys.path.insert(0, str(REPO / "bench"))
import measure_all  # noqa: E402
from peer_jobs.account import account, loss_deviation, losses, summarise  # noqa: E402


def step(s: int, t: float, writer: str = "rank0", pid: int = 1, participants: int = 4) -> dict:
    return {"event": "step", "step": s, "time": t, "writer": writer, "pid": pid, "participants": participants}


def test_a_restart_from_a_checkpoint_counts_every_step_since_it_as_recomputed():
    # steps 0..7 at t = 0..7, the fault at 7.5, the job resumes from the checkpoint at step 5
    events = [step(s, float(s)) for s in range(8)]
    events += [{"event": "resumed", "start": 0, "time": -1.0, "pid": 1, "rank": r, "node": f"node{r // 2}"}
               for r in range(4)]
    # after the restart the new node1 rendezvoused first: it holds ranks 0-1 now
    events += [{"event": "resumed", "start": 5, "time": 20.0, "pid": 2, "rank": r, "node": f"node{1 - r // 2}"}
               for r in range(4)]
    events += [step(s, 21.0 + s, pid=2) for s in range(5, 10)]
    got = account(events, 7.5, full=4)
    assert got["fault_step"] == 7 and got["resumed_from"] == 5 and got["ranks_moved"] == [0, 1, 2, 3]
    assert got["recomputed"] == [5, 6, 7] and got["recomputed_steps"] == 3
    assert got["fault_to_first_step_seconds"] == pytest.approx(26.0 - 7.5)
    assert got["degraded_steps"] == 0 and got["last_step"] == 9


def test_the_step_in_flight_at_the_fault_is_not_progress_after_it():
    # rank 0 (node0) finishes step 8, whose collectives completed before node1 died, after the
    # fault; the job's first step after it is the restarted job's
    events = [step(s, float(s)) for s in range(8)] + [step(8, 7.6)]
    events += [step(s, 30.0 + s, pid=2) for s in range(5, 10)]
    events.append(step(7, 7.55, writer="group1", pid=3))  # a writer a little behind logs step 7 late
    events.insert(0, step(6, 6.0, writer="group1", pid=3))
    got = account(events, 7.5, full=4)
    assert got["fault_step"] == 7
    assert got["fault_to_first_step_seconds"] == pytest.approx(35.0 - 7.5)
    assert got["recomputed"] == [5, 6, 7, 8]


def test_survivors_that_go_on_without_the_dead_replicas_are_degraded_not_recomputed():
    # torchft: 4 groups; groups 2 and 3 die at 5.5; 0 and 1 go on alone from 10 s (after the
    # heartbeat timeout) for steps 6..8; the replacements heal to step 9 and all four go on
    events = [step(s, float(s), writer=f"group{g}", pid=g) for s in range(6) for g in range(4)]
    events += [step(s, 10.0 + s, writer=f"group{g}", pid=g, participants=2) for s in (6, 7, 8) for g in (0, 1)]
    events += [step(s, 20.0 + s, writer=f"group{g}", pid=g + 10) for s in (9, 10) for g in range(4)]
    got = account(events, 5.5, full=4)
    assert got["recomputed_steps"] == 0
    assert got["degraded"] == [6, 7, 8]
    assert got["fault_to_first_step_seconds"] == pytest.approx(16.0 - 5.5)
    assert got["fault_to_full_world_seconds"] == pytest.approx(29.0 - 5.5)


def test_a_survivor_that_restarts_in_its_own_process_makes_progress_after_the_fault():
    # NVRx: rank 0 (pid 1) survives; the wrapper restarts its function in the same process at
    # 9.0, the state kept in memory: its next step (8) is progress, and nothing is recomputed
    events = [step(s, float(s)) for s in range(8)]
    events.append({"event": "resumed", "start": 8, "time": 9.0, "pid": 1})
    events += [step(s, 2.0 + s) for s in (8, 9)]
    got = account(events, 7.5, full=4)
    assert got["fault_to_first_step_seconds"] == pytest.approx(10.0 - 7.5)
    assert got["recomputed_steps"] == 0 and got["resumed_from"] == 8


def test_loss_deviation_reads_the_curve_the_job_went_on_with_after_the_fault():
    """After a restart the recomputed steps' last logged losses are the ones compared; steps before
    the fault and other writers' lines are not; no reference gives no figure."""
    ref = {s: 2.0 - 0.1 * s for s in range(8)}
    events = [{"event": "step", "step": s, "time": float(s), "writer": "rank0", "loss": ref[s]} for s in range(5)]
    events += [{"event": "step", "step": s, "time": 10.0 + s, "writer": "rank0", "loss": ref[s] + 1e-5} for s in (3, 4)]
    events += [{"event": "step", "step": s, "time": 20.0 + s, "writer": "rank0", "loss": ref[s] - 3e-5} for s in (5, 6, 7)]
    events += [{"event": "step", "step": 6, "time": 30.0, "writer": "rank1", "loss": 9.9}]  # another writer
    assert losses(events)[3] == ref[3] + 1e-5
    assert loss_deviation(events, ref, t_fault=4.5) == pytest.approx(3e-5)
    assert loss_deviation(events, None, t_fault=4.5) is None
    fig = summarise([{"kind": "cell", "system": "nvrx", "fault": "kill", "ok": True, "fault_to_first_step_seconds": 1.0,
                      "fault_to_full_world_seconds": 1.0, "recomputed_steps": 0, "degraded_steps": 0, "bitwise": False,
                      "loss_deviation": d} for d in (1e-6, 4e-6)])
    assert fig["peers_nvrx_kill_max_loss_deviation"] == 4e-6


def test_summary_takes_medians_of_finished_cells_and_ratios_of_the_same_run():
    def cell(system, first, recomputed, ok=True):
        return {"kind": "cell", "system": system, "fault": "kill", "ok": ok, "fault_to_first_step_seconds": first,
                "fault_to_full_world_seconds": first, "recomputed_steps": recomputed, "degraded_steps": 0,
                "bitwise": True}

    runs = [cell("sentinel", 2.0, 1), cell("sentinel", 4.0, 0), cell("sentinel", 3.0, 1),
            cell("elastic_dcp", 9.0, 3), cell("elastic_dcp", 12.0, 4), cell("elastic_dcp", 99.0, 9, ok=False),
            {"kind": "steady", "system": "none", "ok": True, "step_seconds": 0.02, "peak_rss_bytes": 1000},
            {"kind": "steady", "system": "elastic_dcp", "ok": True, "step_seconds": 0.03, "peak_rss_bytes": 1500}]
    fig = summarise(runs)
    assert fig["peers_sentinel_kill_fault_to_first_step_seconds"] == 3.0
    assert fig["peers_sentinel_kill_recomputed_steps"] == 1 and fig["peers_sentinel_kill_max_recomputed_steps"] == 1
    assert fig["peers_elastic_dcp_kill_fault_to_first_step_seconds"] == 10.5  # the failed cell is left out
    assert fig["peers_elastic_dcp_kill_ok_fraction"] == pytest.approx(2 / 3)
    assert fig["peers_elastic_dcp_over_sentinel_kill_fault_to_first_step_ratio"] == pytest.approx(10.5 / 3.0)
    assert fig["peers_elastic_dcp_step_over_baseline_ratio"] == pytest.approx(1.5)
    assert fig["peers_elastic_dcp_extra_peak_rss_bytes"] == 500


def test_the_generated_table_has_a_row_for_every_system_the_report_ran_and_none_for_the_others():
    fig = {"peers_sentinel_kill_fault_to_first_step_seconds": 0.9, "peers_sentinel_kill_recomputed_steps": 0,
           "peers_sentinel_kill_bitwise_equal_fraction": 1.0, "peers_sentinel_kill_runs_count": 3,
           "peers_dlrover_kill_runs_count": 3, "peers_dlrover_kill_ok_fraction": 0.0}
    rows = [line for line in measure_all.peers_table({"quiet": fig}) if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| Sentinel", "| DLRover 0.6.1"]
    assert "0.9 / 0 / 0 / 1" in rows[0] and "did not run" in rows[1]  # DLRover ran and failed: its row says so


def test_each_phase_has_its_own_figures_ratios_and_load_average():
    """A loaded phase's cells never mix with the quiet ones: its medians, its ratios over Sentinel
    of the same phase, its own load average; a run without a phase is quiet."""
    def cell(phase, system, first, load):
        return {"kind": "cell", "phase": phase, "system": system, "fault": "kill", "ok": True,
                "fault_to_first_step_seconds": first, "fault_to_full_world_seconds": first, "recomputed_steps": 0,
                "degraded_steps": 0, "bitwise": True, "loadavg": [load, 0, 0]}

    runs = [cell("quiet", "sentinel", 1.0, 2.0), cell("quiet", "torchft", 5.0, 2.2),
            cell("loaded", "sentinel", 2.0, 4.0), cell("loaded", "torchft", 6.0, 4.4),
            {"kind": "steady", "system": "none", "ok": True, "step_seconds": 0.02, "peak_rss_bytes": 1000,
             "loadavg": [1.8, 0, 0]}]
    fig = summarise(runs)
    assert fig["peers_sentinel_kill_fault_to_first_step_seconds"] == 1.0
    assert fig["peers_loaded_sentinel_kill_fault_to_first_step_seconds"] == 2.0
    assert fig["peers_torchft_over_sentinel_kill_fault_to_first_step_ratio"] == pytest.approx(5.0)
    assert fig["peers_loaded_torchft_over_sentinel_kill_fault_to_first_step_ratio"] == pytest.approx(3.0)
    assert fig["peers_load_average_ratio"] == 2.0 and fig["peers_loaded_load_average_ratio"] == pytest.approx(4.2)
    lines = measure_all.peers_table({"quiet": fig})
    heads = [line for line in lines if line.startswith("Systems side by side")]
    assert len(heads) == 2 and "load average 2.0" in heads[0] and "loaded phase" in heads[1] \
        and "load average 4.2" in heads[1]
    rows = [line for line in lines if line.startswith("| torchft 0.2.0 |")]
    assert "5 (5x)" in rows[0] and "6 (3x)" in rows[1]


def test_the_busy_loops_end_with_their_phase_and_with_a_killed_harness():
    """bench/peers.py's loaded phase: its busy loops are gone when the phase ends, and when the
    harness is SIGKILLed (no cleanup runs) each ends by itself."""
    import subprocess
    import time

    import peers

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
        except FileNotFoundError:
            return False

    with peers.BusyLoops(2) as loops:
        pids = [p.pid for p in loops.procs]
        assert all(alive(pid) for pid in pids)
    assert not any(alive(pid) for pid in pids)
    harness = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path[:0] = sys.argv[1:]; import peers\n"
                                "loops = peers.BusyLoops(1).__enter__(); print(loops.procs[0].pid, flush=True); "
                                "time.sleep(600)", str(REPO / "bench")], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(harness.stdout.readline())
        assert alive(pid)
    finally:
        harness.kill()
        harness.wait()
    end = time.monotonic() + 30
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.1)
    assert not alive(pid), "a busy loop outlived its harness"


def test_pins_are_the_extra_and_the_venv_script_the_same():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["peers"]
    script = (REPO / "scripts" / "peers-venvs").read_text()
    pinned = set(re.findall(r"\[(?:torchft|nvrx|dlrover)\]=\"([^\"]+)\"", script))
    assert {p for line in pinned for p in line.split()} == set(extra)
    assert all("==" in p for p in extra), "every peer is pinned to an exact version"


def test_smoke_kills_node1_at_the_same_step_for_sentinel_and_torch_elastic(tmp_path: Path):
    """bench/peers.py --smoke for real: each system's kill lands at the smoke's step (6) or the one
    after (the harness sees the step logged, then kills); Sentinel recomputes at most one step
    (its memory tier) and ends bitwise equal to its uninterrupted run; torch elastic + DCP resumes
    from its last complete checkpoint (every 5 steps; the one an async save was still writing when
    node1 died is not complete, so at most one interval more), recomputes exactly the steps since
    it (its bitwise equality is reported, not asserted: see the comment below)."""
    doc, out = run_smoke("peers", tmp_path)
    cells = {r["system"]: r for r in doc["runs"] if r["kind"] == "cell"}
    assert set(cells) == {"sentinel", "elastic_dcp"}, out
    for system, c in cells.items():
        assert c["ok"], (system, c.get("error"))
        assert c["fault_step"] in (6, 7), (system, c["fault_step"])
        assert isinstance(c["bitwise"], bool), (system, c)  # measured and reported for every system
    # Sentinel's own bound; torch elastic + DCP's equality is the peer's, reported in the table: it
    # came out unequal in some runs (CI at load ~8, and the full run), cause not found (known-limits)
    assert cells["sentinel"]["bitwise"], "sentinel: final parameters differ from its uninterrupted run"
    assert cells["sentinel"]["recomputed_steps"] <= 1
    e = cells["elastic_dcp"]
    assert e["resumed_from"] % 5 == 0 and e["fault_step"] - 10 < e["resumed_from"] <= e["fault_step"] + 1
    # exactly the steps since that checkpoint, through the fault's step or the one its ranks were
    # finishing as the kill landed (logged just after it: account.py's in-flight step; ci18a at load ~8)
    assert e["recomputed"] in (list(range(e["resumed_from"], e["fault_step"] + 1)),
                               list(range(e["resumed_from"], e["fault_step"] + 2))), e
    assert isinstance(e["loss_deviation"], float), e  # the curve after the restart against its steady run's
    assert "Sentinel" in out and "torch elastic + DCP" in out
