"""`sentinel drill` end to end: real daemons, real elastic agents (warm by default, plain torchrun
with --agent torchrun), c10d rendezvous, spares."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench_smoke import run_smoke
from conftest import REPO, session_shared_dir

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]
pytest.importorskip("torch")


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> Path:
    """The drills' --reference-cache: the uninterrupted runs --verify compares with, one per world
    size, shared by every drill of the session (cached_reference is tested on its own below)."""
    return session_shared_dir(tmp_path_factory, "drill-references")


def drill(*args: str, timeout: float = 400, references: Path | None = None) -> dict:
    cache = ["--reference-cache", str(references)] if references is not None else []
    # the drill's own bound on the whole run (default 180 s) is the harness's, not the product's:
    # two suites on a slow 2-core host spent 80 s of it starting the nodes (session 11)
    bound = [] if "--timeout" in args else ["--timeout", str(timeout - 60)]
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--json", *args, *bound, *cache], capture_output=True,
                       text=True, timeout=timeout, cwd=REPO)
    assert r.stdout.strip().startswith("{"), r.stdout[-2000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)  # stdout is the result alone: progress goes to stderr
    result["rc"] = r.returncode
    result["stderr"] = r.stderr
    return result


def why(result: dict) -> str:
    """A failed drill's stderr tail, its stages, and last what decided its "ok": last, because a
    CI log keeps the head and the tail of a long failure and cuts its middle (it cut this once)."""
    keys = ("rc", "ok", "finished", "spare_in_place", "recomputed_steps", "lost_steps", "final_nodes", "final_nodes_ok",
            "other_migrations", "restore", "notes", "verify", "job_health", "trip_to_first_step_seconds")
    brief = {k: result.get(k) for k in keys if k in result}
    return (result.get("stderr", "")[-3000:] + f"\nstages: {[e.get('stage') for e in result.get('timeline', [])]}\n"
            + "what decided ok: " + "\n  ".join(f"{k}={v!r}"[:400] for k, v in brief.items()))


def stages(result: dict) -> list[str]:
    return [e["stage"] for e in result["timeline"]]


def at(result: dict, stage: str) -> float:
    return next(e["time"] for e in result["timeline"] if e["stage"] == stage)


# Stage times are each taken by the process that lived the stage (the drill, the daemon, the
# workers), with time.time(). Only the order causality fixes is asserted: the daemon's own
# sequence, each spare worker's own sequence, and that no spare worker starts before the cordon
# that precedes the drain making room for it. Events of different processes that race (the
# daemon recording "agent stopped" while the spare already starts) are not ordered.
DAEMON_STAGES = ["fault injected", "detected", "snapshot requested", "snapshot committed", "node cordoned",
                 "agent stopped"]
SPARE_STAGES = ["spare workers started", "spare admitted", "snapshot loaded", "first step on the spare", "job finished"]


def in_order(result: dict, names: list[str]) -> bool:
    times = [at(result, s) for s in names]
    return times == sorted(times)


def test_xid79_migrates_to_the_spare_with_no_lost_step_and_bitwise_equal_result(references):
    """Merged (#29): also what test_warm_spare_is_admitted_and_trains_and_survivors_leave_their_hold_
    within_a_second_of_the_drain checked, from a second drill of the same fault."""
    r = drill("--fault", "xid79", "--verify", references=references)
    assert r["rc"] == 0 and r["ok"], why(r)
    assert r["recomputed_steps"] == [] and r["spare_in_place"] and "node1" not in r["final_nodes"]
    assert "spare0" in r["final_nodes"] and r["finished"]
    assert r["verify"]["bitwise_equal"]
    assert sorted(stages(r)) == sorted(DAEMON_STAGES + SPARE_STAGES + ["survivors left the hold"]), r["timeline"]
    assert in_order(r, DAEMON_STAGES) and in_order(r, SPARE_STAGES), r["timeline"]
    started = next(e for e in r["timeline"] if e["stage"] == "spare workers started")
    # the spare's agent was running (warm) long before; its workers are forks made at the admission
    assert started["warm"] and started["time"] >= at(r, "node cordoned"), r["timeline"]
    committed = next(e for e in r["timeline"] if e["stage"] == "snapshot committed")
    loaded = next(e for e in r["timeline"] if e["stage"] == "snapshot loaded")
    first = next(e for e in r["timeline"] if e["stage"] == "first step on the spare")
    assert loaded["start_step"] == committed["step"] + 1 == first["step"] and committed["ok"]
    # the drain is the SIGTERM, sent after the cordon; the survivors leave their hold before they
    # can train with the spare (causal order only: under two suites it came 1.1 s after the
    # daemon's "agent stopped" record, a bound of 1.0 s failed)
    left = at(r, "survivors left the hold")
    assert at(r, "node cordoned") <= left <= at(r, "first step on the spare"), r["timeline"]
    assert r["trip_to_first_step_seconds"] < 60
    # progress on stderr while it runs: what it starts, what it waits for, the fault
    progress = [line.split(": ", 1)[1] for line in r["stderr"].splitlines() if line.startswith("sentinel drill ")]
    assert progress[0].startswith("starting 2 node(s) and 1 spare(s)")
    assert "fault xid79 injected into node1" in progress and any(p.startswith("waiting for step 25 ") for p in progress)
    assert any(p.startswith("waiting for the job to finish") for p in progress)


def test_sudden_kill_without_the_memory_tier_resumes_from_the_periodic_disk_snapshot():
    r = drill("--fault", "kill", "--interval-steps", "10", "--memory-interval-steps", "0")
    assert r["ok"], why(r)
    assert 0 < len(r["recomputed_steps"]) <= 10 and r["spare_in_place"]
    assert "detected" not in stages(r)  # nothing warned; the periodic snapshot is the fallback
    assert r["restore"]["tier"] == "disk"


def test_rank_crash_with_a_cold_spare_present_ends_with_the_job_running():
    # A spare inside the rendezvous plus a crash re-rendezvouses N+1 nodes for N slots forever:
    # cold spares (torchrun) and warm ones (waiting outside the rendezvous: see
    # test_rank_crash_restores_from_the_node_s_own_memory_without_disk_or_peer) must both avoid it.
    r = drill("--fault", "rank-crash", "--interval-steps", "10", "--agent", "torchrun")
    assert r["ok"], why(r)
    assert r["finished"] and "node1" in r["final_nodes"] and len(r["recomputed_steps"]) <= 10
    assert "spare0" not in r["final_nodes"]


def test_sudden_kill_of_a_whole_node_loses_at_most_one_step_with_the_memory_tier(references):
    r = drill("--fault", "kill", "--verify", references=references)
    assert r["ok"], why(r)
    assert len(r["recomputed_steps"]) <= 1 and r["spare_in_place"] and r["verify"]["bitwise_equal"]
    # the killed node's memory died with it: its shard came from the replica on the survivor. Which
    # rank the spare gets depends on the rendezvous order: shard 0 or 1 is pulled, the other is own
    restore = r["restore"]
    assert restore["tier"] == "memory" and len(restore["peer"]) == 1 and sorted(restore["own"] + restore["peer"]) == [0, 1]
    loaded = next(e for e in r["timeline"] if e["stage"] == "snapshot loaded")
    assert loaded["tier"] == "memory" and loaded["source"].startswith("memory:step-")
    # #48: the slot rendezvous (the kill's default) declared the dead node from a refused probe of
    # its agent — started by a survivor's own connection error, or by the admitted spare, whichever
    # came first — not from keep-alive expiry, before the spare's workers started
    declared = next(e for e in r["timeline"] if e["stage"] == "dead node declared")
    assert declared["how"] == "probe" and declared["evidence"], declared
    assert r["fault_to_declared_seconds"] <= r["fault_to_spare_workers_seconds"] <= r["fault_to_first_step_seconds"]


def test_two_nodes_holding_each_other_s_replicas_killed_fall_back_to_disk_and_say_so(references):
    r = drill("--fault", "kill", "--victims", "2", "--spares", "2", "--verify", references=references)
    assert r["ok"], why(r)
    assert sorted(r["final_nodes"]) == ["spare0", "spare1"] and r["verify"]["bitwise_equal"]
    assert r["restore"]["tier"] == "disk" and 0 < len(r["recomputed_steps"]) <= 10
    assert any("fell back to the newest disk snapshot" in n for n in r["notes"])


def test_rank_crash_restores_from_the_node_s_own_memory_without_disk_or_peer():
    """Merged (#29): also the warm case of the rank-crash-with-a-spare test (the same drill): the
    warm spare waiting outside the rendezvous is not pulled in, the job ends running on node1."""
    r = drill("--fault", "rank-crash", "--interval-steps", "10")  # --agent warm, the default
    assert r["ok"], why(r)
    assert r["finished"] and "node1" in r["final_nodes"] and len(r["recomputed_steps"]) <= 1
    assert "spare0" not in r["final_nodes"]
    assert r["restore"]["tier"] == "memory" and r["restore"]["peer"] == [] and r["restore"]["own"] == [0, 1]


def test_two_nodes_fail_at_once(references, tmp_path):
    """Also bench/loaded_rendezvous.py's smoke in the suite (bench_smoke.OWN_TEST): the bench's one
    drill is this one (c10d, 3 nodes, 2 spares, both victims at once, --verify), run at the drill's
    default length (60 steps, the fault at 25) instead of the smoke's 12 and 4 so that it shares
    the session's uninterrupted run of 3 ranks; its report holds every figure the bench promises
    (run_smoke), and the drill's record what is asserted below. One drill for both, not two."""
    doc, out = run_smoke("loaded_rendezvous", tmp_path, "--steps", "60", "--at-step", "25",
                         "--reference-cache", str(references), "--timeout", "340")
    (run,) = doc["runs"]
    r = run["drill"]
    r["stderr"] = r.get("error", "")  # why(): the drill's stderr tail, which the bench keeps when it failed
    assert run["backend"] == "c10d" and run["busy"] == 0, run
    assert r["rc"] == 0 and r["ok"], why(r) + "\n" + out[-2000:]
    assert doc["figures"]["loaded_two_victims_c10d_ok_fraction"] == 1.0
    assert sorted(r["final_nodes"]) == ["node0", "spare0", "spare1"] and r["recomputed_steps"] == []
    assert r["other_migrations"][0]["phase"] == "drained"
    assert r["membership_changes"] == 1  # both nodes replaced in one re-rendezvous, not one after another
    # of 3 nodes any 2 hold each other's replica: one shard survives nowhere in memory. Its new rank
    # reads it from the (durable) migrate snapshot on disk while the other two come from memory
    restore = r["restore"]
    assert restore["tier"] == "memory" and len(restore["disk"]) == 1, restore
    # a new rank 0 after the membership change: its agent hosts the workers' store (trainer.elastic
    # forgets torch's cached address every round), not its worker
    assert next(e for e in r["timeline"] if e["stage"] == "spare admitted")["worker_store"] == ["agent"]
    assert sorted(restore["own"] + restore["peer"] + restore["disk"]) == [0, 1, 2]
    assert r["verify"]["bitwise_equal"]


def test_plain_torchrun_with_a_cold_spare_still_migrates():
    r = drill("--fault", "xid79", "--agent", "torchrun")
    assert r["ok"] and r["spare_in_place"] and r["recomputed_steps"] == [], why(r)
    assert not next(e for e in r["timeline"] if e["stage"] == "spare workers started")["warm"]
    # plain torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the rank-0 worker hosts the store
    assert next(e for e in r["timeline"] if e["stage"] == "spare admitted")["worker_store"] == ["worker"]


def test_no_spare_continues_on_fewer_nodes_when_nnodes_allows():
    # disk only: a world-size change cannot use the memory tier, and with it on the drain can beat
    # the disk copy of the memory-committed migrate snapshot (docs/memory-tier.md)
    r = drill("--spares", "0", "--min-nodes", "1", "--memory-interval-steps", "0")
    assert r["ok"], why(r)
    assert r["final_nodes"] == ["node0"] and r["world_after"] == 1 and r["recomputed_steps"] == []
    loaded = next(e for e in r["timeline"] if e["stage"] == "snapshot loaded")
    committed = next(e for e in r["timeline"] if e["stage"] == "snapshot committed")
    assert loaded["start_step"] == committed["step"] + 1  # resharded 2 -> 1 from the migrate snapshot


def test_no_spare_and_no_room_to_shrink_is_reported_not_hung():
    # --timeout bounds the whole drill (start-up under load included); the wait for a node that
    # never comes is reported NO_NODE_WAIT_SECONDS after the fault, once the survivor's agent said
    # whom its round waits for (a 60 s budget once ran out before step 25 on a host running two suites)
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--spares", "0", "--timeout", "300"],
                       capture_output=True, text=True, timeout=420, cwd=REPO)
    assert r.returncode == 1
    assert "no spare left" in r.stderr and "waiting for a node" in r.stderr
    assert "waiting for the job to finish" in r.stderr.splitlines()[-1], r.stderr[-1000:]
    # #47: not a silent timeout: the survivor's agent said whom its round waits for, and the drill printed it
    stall = next((x for x in r.stderr.splitlines() if x.startswith("sentinel drill: node0's agent: rendezvous stalled:")),
                 "")
    assert "in the round 1 of 2 needed" in stall and "(this node)" in stall, r.stderr[-2000:]


def test_spare_dying_during_the_migration_is_replaced_by_the_next():
    r = drill("--spares", "2", "--kill-spare")
    assert r["ok"], why(r)
    assert r["final_nodes"] == ["node0", "spare1"] and r["recomputed_steps"] == []
    assert any("spare0 died during the migration" in n for n in r["notes"])


@pytest.mark.needs_root
def test_failed_migrate_snapshot_still_drains_and_resumes_from_the_older_one():
    import os

    if os.geteuid() != 0:
        pytest.skip("filling a real filesystem needs root to mount a small tmpfs")
    r = drill("--fail-snapshot", "--interval-steps", "10", "--memory-interval-steps", "0")  # the disk-only path
    assert r["ok"], why(r)
    committed = next(e for e in r["timeline"] if e["stage"] == "snapshot committed")
    loaded = next(e for e in r["timeline"] if e["stage"] == "snapshot loaded")
    assert committed["ok"] is False and loaded["start_step"] <= committed["step"]
    assert any("previous snapshot" in n for n in r["migration_notes"])
    assert r["spare_in_place"]
    # What is guaranteed (how many steps that is depends on how fast the fault was caught): the
    # job resumes from the newest snapshot that committed before it, and recomputes exactly the
    # steps from there to the migrate step it held at.
    before = [s for s in r["snapshots"] if s["time"] < loaded["time"]]
    # (the failed migrate snapshot itself may or may not be logged before its ranks are drained)
    assert not any(s["ok"] and s["step"] == committed["step"] for s in before)
    newest_ok = max(s["step"] for s in before if s["ok"])
    assert loaded["start_step"] == newest_ok + 1 and loaded["source"].endswith(f"step-{newest_ok:09d}")
    assert r["recomputed_steps"] == list(range(newest_ok + 1, committed["step"] + 1))


def test_rank_preserving_rendezvous_replaces_two_nodes_in_one_generation_with_no_lost_step(references):
    r = drill("--nodes", "3", "--spares", "2", "--victims", "2", "--fault", "dbe", "--rdzv-backend", "sentinel",
              "--verify", references=references)
    assert r["ok"], why(r)
    assert sorted(r["final_nodes"]) == ["node0", "spare0", "spare1"] and r["recomputed_steps"] == []
    assert r["membership_changes"] == 1  # both slots filled in one generation
    assert r["verify"]["bitwise_equal"]


def test_the_slot_rendezvous_on_a_three_member_etcd_replaces_two_nodes_in_one_generation(references):
    """--rdzv-backend sentinel-etcd on loopback: the same hand-over through 3 TLS etcd members."""
    r = drill("--nodes", "3", "--spares", "2", "--victims", "2", "--fault", "dbe", "--rdzv-backend", "sentinel-etcd",
              "--verify", references=references)
    assert r["ok"], why(r)
    assert sorted(r["final_nodes"]) == ["node0", "spare0", "spare1"] and r["recomputed_steps"] == []
    assert r["membership_changes"] == 1
    assert r["verify"]["bitwise_equal"]


def test_sentinel_rendezvous_needs_the_warm_agent():
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--agent", "torchrun", "--rdzv-backend", "sentinel"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "needs --agent warm" in r.stderr


def test_the_reference_cache_reuses_one_run_per_world_steps_and_code_and_never_keeps_a_failed_one(tmp_path, monkeypatch):
    """--reference-cache: the second drill of the same job reuses the first's uninterrupted run;
    another world size or step count, or another trainer code, is another run; a failed run is
    not kept (the next drill runs it again)."""
    from sentinel_tools import drill_report as drill_mod  # where cached_reference lives

    repo = tmp_path / "repo"
    (repo / "trainer").mkdir(parents=True)
    (repo / "trainer" / "train.py").write_text("# v1\n")
    monkeypatch.setattr(drill_mod, "repo_root", lambda: repo)
    runs: list[Path] = []

    def run(d: Path, result=("p1", "o1")):
        runs.append(d)
        assert d.is_dir() and d.parent == cache
        return ({"params": result[0], "optim": result[1]}, "") if result else (None, "rank 1 failed")

    cache = tmp_path / "cache"
    first = drill_mod.cached_reference(cache, 2, 60, run)
    assert first == ({"params": "p1", "optim": "o1"}, "") and len(runs) == 1
    assert drill_mod.cached_reference(cache, 2, 60, run) == first and len(runs) == 1  # reused
    drill_mod.cached_reference(cache, 3, 60, run)
    drill_mod.cached_reference(cache, 2, 30, run)
    assert len(runs) == 3  # another world size, another step count
    (repo / "trainer" / "train.py").write_text("# v2\n")
    drill_mod.cached_reference(cache, 2, 60, run)
    assert len(runs) == 4  # the trainer changed: the old run no longer counts
    (repo / "trainer" / "train.py").write_text("# v3\n")
    assert drill_mod.cached_reference(cache, 2, 60, lambda d: run(d, None)) == (None, "rank 1 failed")
    assert drill_mod.cached_reference(cache, 2, 60, run)[0] == {"params": "p1", "optim": "o1"} and len(runs) == 6
    assert not [p for p in cache.iterdir() if p.is_dir()]  # the runs' work directories are removed


def test_a_hung_rank_alone_on_its_node_is_handed_over_by_the_forwarded_verdict(references):
    """#41: with one rank per node the culprit's daemon hears nothing from its own (stopped) rank;
    the live rank's daemon forwards the verdict to it (sentinel.peers) and the node is handed over."""
    r = drill("--fault", "hang", "--verify", references=references)
    assert r["ok"] and r["rc"] == 0, why(r)
    assert len(r["recomputed_steps"]) <= 1 and r["verify"]["bitwise_equal"], why(r)
    assert r["job_health"]["rule"] == "hang" and "forwarded by node0's daemon" in r["job_health"]["reason"], why(r)
    assert r["job_health"]["last_completed_step_to_handover_seconds"] <= 60, why(r)
