"""The memory tier (trainer/memory/): slots, inventory, restore planning, budget; and end to end
with 4 ranks on 2 simulated nodes (each with its own holder directory). The ranks are forks of one
interpreter that imported torch once (tests/workers/forkrun.py: torchrun's environment, a third of
the CPU of torchrun's five interpreters); what is tested is what the ranks do, not the launcher,
which test_trainer and the drills run as torchrun and trainer.elastic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, SYSTEM_PYTHON, made_once

pytestmark = [pytest.mark.needs_torch]
torch = pytest.importorskip("torch")

from trainer.memory import (  # noqa: E402
    COMPLETE, DISK, OWN, REPLICA, WRITING, Layout, MemoryBudgetError, MemoryTier, MemoryTierError, Slot, SlotInfo,
    ensure_holder, inventory, plan_restore, ring_partners, slot_name,
)


# -- pure parts ------------------------------------------------------------------------------------
def info(role: str, shard: int, step: int, slot: int = 0) -> SlotInfo:
    return SlotInfo(slot_name(role, shard, slot), role, shard, slot, COMPLETE, step, 100, None,
                    {"run": "r", "world": 4, "shard": shard, "layout": f"L{shard}"})


def test_ring_placement_is_same_local_rank_on_the_next_node():
    assert [ring_partners(r, 8, 2) for r in range(8)] == [(2, 6), (3, 7), (4, 0), (5, 1), (6, 2), (7, 3), (0, 4), (1, 5)]
    assert ring_partners(1, 4, 2) == (3, 3)  # two nodes: each holds the other's replicas


def test_agreement_picks_the_newest_step_every_shard_has_when_ranks_hold_different_newest_steps():
    holders = ["A", "A", "B", "B"]
    found = {  # node A got to step 9, node B only to 8 (its 9 was torn); replicas lag one more
        "A": [info(OWN, 0, 9), info(OWN, 0, 8, 1), info(OWN, 1, 9), info(OWN, 1, 8, 1),
              info(REPLICA, 2, 8), info(REPLICA, 3, 8)],
        "B": [info(OWN, 2, 8), info(OWN, 2, 7, 1), info(OWN, 3, 8), info(OWN, 3, 7, 1),
              info(REPLICA, 0, 8), info(REPLICA, 1, 7)],
    }
    plan, why = plan_restore(4, holders, found)
    assert why == "" and plan.step == 8
    assert plan.local == [0, 1, 2, 3] and plan.peer == [] and all(s is None for s in plan.senders.values())
    assert plan.sources[0][1] == "own-00000-1.mem"  # its own copy at 8, not the replica on B


def test_a_dead_node_s_shards_come_from_the_replica_on_its_peer():
    holders = ["A", "A", "S", "S"]  # node B died; spare S took its ranks, with empty memory
    found = {"A": [info(OWN, 0, 5), info(OWN, 1, 5), info(REPLICA, 2, 5), info(REPLICA, 3, 5)], "S": []}
    plan, _ = plan_restore(4, holders, found)
    assert plan.step == 5 and plan.local == [0, 1] and plan.peer == [2, 3]
    assert plan.senders == {0: None, 1: None, 2: 0, 3: 1}  # the load is spread over A's ranks


def test_both_copies_lost_means_no_memory_plan_and_says_which_shard():
    holders = ["S0", "S0", "S1", "S1"]
    plan, why = plan_restore(4, holders, {"S0": [], "S1": []})
    assert plan is None and why == "no memory snapshot of this run"
    plan, why = plan_restore(4, ["A", "A", "S", "S"], {"A": [info(OWN, 0, 5), info(OWN, 1, 5)], "S": []})
    assert plan is None and "shard(s) [2, 3]" in why and "both lost" in why


def test_a_shard_whose_every_copy_died_is_read_from_disk_at_the_disk_snapshot_s_step():
    # nodes B and C failed together and C held B's replica: shards 2, 3 exist nowhere in memory
    holders = ["A", "A", "S", "S"]
    found = {"A": [info(OWN, 0, 5), info(OWN, 1, 5), info(OWN, 0, 4, 1), info(OWN, 1, 4, 1)], "S": []}
    plan, why = plan_restore(4, holders, found, disk_step=5)
    assert why == "" and plan.step == 5 and plan.local == [0, 1] and plan.peer == [] and plan.disk == [2, 3]
    assert plan.senders == {0: None, 1: None, 2: DISK, 3: DISK}
    # only at the disk snapshot's own step: any other step would mix two points of the training
    assert plan_restore(4, holders, found, disk_step=3)[0] is None
    assert plan_restore(4, holders, found, disk_step=4)[0].step == 4
    assert plan_restore(4, holders, found)[0] is None  # no disk reader: the caller loads all from disk
    # nothing from memory at all: that is a plain disk load, not a memory restore
    plan, why = plan_restore(4, ["S", "S", "T", "T"], {"A": [info(OWN, 0, 5)], "S": [], "T": []}, disk_step=5)
    assert plan is None and "shard(s) [1, 2, 3]" in why


def test_a_complete_memory_step_newer_than_the_disk_snapshot_needs_no_disk():
    holders = ["A", "A", "B", "B"]
    found = {"A": [info(OWN, 0, 6), info(OWN, 1, 6), info(REPLICA, 2, 6), info(REPLICA, 3, 6)],
             "B": [info(OWN, 2, 6), info(OWN, 3, 6)]}
    plan, _ = plan_restore(4, holders, found, disk_step=5)
    assert plan.step == 6 and plan.disk == [] and plan.local == [0, 1, 2, 3]


def test_a_copy_of_another_layout_is_never_chosen():
    holders = ["A", "A", "B", "B"]
    found = {"A": [info(OWN, 0, 3), info(OWN, 1, 3)], "B": [info(OWN, 2, 3), info(OWN, 3, 3)]}
    assert plan_restore(4, holders, found, ["L0", "L1", "L2", "L3"])[0].step == 3
    plan, why = plan_restore(4, holders, found, ["L0", "L1", "other", "L3"])
    assert plan is None and "[2]" in why


def state(n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"app": {"w": torch.randn(n, generator=g), "b": torch.arange(7, dtype=torch.int64),
                    "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}]}}


def test_slot_roundtrip_restores_tensors_and_values_exactly(tmp_path):
    holder = ensure_holder(tmp_path / "h")
    src = state()
    layout = Layout.of(src)
    slot = Slot(holder / slot_name(OWN, 0, 0), layout.data_len)
    slot.begin(4)
    layout.stage(src, slot.views(layout))
    slot.finish(4, {"run": "r", "world": 1, "shard": 0, "layout": layout.hash, "values": layout.values(src)}, slot.crc())
    dst = state()
    dst["app"]["w"].zero_()
    dst["app"]["groups"][0]["lr"] = 7.0
    st, step, crc, meta = slot.header()
    assert (st, step, crc) == (COMPLETE, 4, slot.crc())
    layout.restore_into(dst, slot.views(layout), meta["values"])
    assert torch.equal(dst["app"]["w"], src["app"]["w"]) and torch.equal(dst["app"]["b"], src["app"]["b"])
    assert dst["app"]["groups"][0]["lr"] == 0.1 and dst["app"]["groups"][0]["betas"] == (0.9, 0.99)  # a tuple again
    slot.close()


def write_slot(holder: Path, role: str, shard: int, step: int, *, run: str = "r", world: int = 1, torn: bool = False):
    src = state()
    layout = Layout.of(src)
    slot = Slot(holder / slot_name(role, shard, 0), layout.data_len)
    slot.begin(step)
    layout.stage(src, slot.views(layout))
    if not torn:
        slot.finish(step, {"run": run, "world": world, "shard": shard, "layout": layout.hash, "values": {}}, None)
    slot.close()


def test_inventory_never_offers_a_torn_copy_or_stale_memory_of_another_run(tmp_path):
    holder = ensure_holder(tmp_path / "h")
    write_slot(holder, OWN, 0, 10, torn=True)  # the writer died mid-copy
    write_slot(holder, REPLICA, 1, 9, run="old-job")  # a node back with memory of an older run
    write_slot(holder, REPLICA, 2, 9, world=8)  # the same run at another world size
    (holder / "own-garbage.mem").write_bytes(b"x" * 100)  # not a slot name: not ours to judge
    (holder / slot_name(OWN, 3, 0)).write_bytes(b"\0" * 10)  # a short, empty file
    found, rejected = inventory(holder, run="r", world=1)
    assert found == []
    assert rejected["torn"] == 1 and rejected["stale_run"] == 1 and rejected["other_world"] == 1
    write_slot(holder, OWN, 0, 11)
    found, _ = inventory(holder, run="r", world=1)
    assert [(f.role, f.shard, f.step) for f in found] == [(OWN, 0, 11)]


def test_a_holder_another_user_could_write_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    with pytest.raises(MemoryTierError, match="open to others"):
        ensure_holder(d)
    (tmp_path / "link").symlink_to(tmp_path / "h2", target_is_directory=True)
    (tmp_path / "h2").mkdir()
    with pytest.raises(MemoryTierError, match="not a directory"):
        ensure_holder(tmp_path / "link")


# -- a holder no other user can claim (issue #24, point 5) -----------------------------------------
HOLDER_AS_JOB = r"""
import json, logging, sys
logging.basicConfig()
from pathlib import Path
from trainer.memory.place import default_holder_dir, ensure_holder, holder_id  # no torch: the system Python
shm, run_user, local_rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
h = ensure_holder(default_holder_dir(shm=shm, run_user=run_user, local_rank=local_rank, wait_seconds=10))
print(json.dumps([str(h), holder_id(h)]), flush=True)
"""


@pytest.mark.needs_root
@pytest.mark.parametrize("with_run_user", [False, True])
def test_a_squatted_holder_name_does_not_stop_the_memory_tier(attacker, shared_tmp, with_run_user):
    """Another user made /dev/shm/sentinel-<the job's uid> first. The job's ranks (nobody here) take
    /run/user/<uid>/sentinel where logind made it, else a /dev/shm/sentinel-<uid>-<random> that
    local rank 0 creates and every rank of the node finds again by its verified owner — never the
    attacker's look-alike."""
    job_uid = 65534
    shm = shared_tmp / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    run_user = shared_tmp / "run-user"
    run_user.mkdir()
    if with_run_user:
        (run_user / str(job_uid)).mkdir(mode=0o700)
        os.chown(run_user / str(job_uid), job_uid, job_uid)
    squat = (f"mkdir -m 777 {shm}/sentinel-{job_uid} && mkdir -m 700 {shm}/sentinel-{job_uid}-0000000000000000 "
             f"&& mkdir -m 700 {shm}/sentinel-{job_uid}-ffffffffffffffff")
    r = attacker.run(["sh", "-c", squat])
    assert r.returncode == 0, r.stderr

    def rank(local_rank):
        return subprocess.Popen([SYSTEM_PYTHON, "-c", HOLDER_AS_JOB, str(shm), str(run_user), str(local_rank)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=job_uid,
                                group=job_uid, extra_groups=[], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})

    ranks = [rank(1), rank(2), rank(0)]  # the others start first and wait for local rank 0
    outs = [p.communicate(timeout=120) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), [err for _, err in outs]
    chosen = {tuple(json.loads(out)) for out, _ in outs}
    assert len(chosen) == 1, chosen  # one holder (one holder id) for the whole node
    ((path, _id),) = chosen
    path = Path(path)
    if with_run_user:
        assert path == run_user / str(job_uid) / "sentinel"
    else:
        assert path.parent == shm and path.name.startswith(f"sentinel-{job_uid}-")
        assert path.name not in (f"sentinel-{job_uid}-0000000000000000", f"sentinel-{job_uid}-ffffffffffffffff")
    st = path.stat()
    assert st.st_uid == job_uid and st.st_mode & 0o777 == 0o700
    assert "squatted" in outs[-1][1]
    # a restart finds the same holder again
    again = rank(0)
    out, err = again.communicate(timeout=60)
    assert tuple(json.loads(out)) == (str(path), _id), err


@pytest.mark.needs_root
def test_a_full_dev_shm_is_a_clear_refusal_naming_the_size_needed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "sentinel-test", str(mnt)], check=True)
    try:
        tier = MemoryTier(mnt / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
        big = {"w": torch.zeros(1 << 20)}  # 4 MiB per copy, 3 own slots
        with pytest.raises(MemoryBudgetError, match=r"needs 12\.\d MiB, has [0-4]\.\d MiB free") as exc:
            tier.setup(big)
        assert "SENTINEL_MEMORY_DIR" in str(exc.value) and "memory_interval_steps=0" in str(exc.value)
        assert not list((mnt / "h").glob("*.mem"))  # refused before anything was allocated
        small = MemoryTier(mnt / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
        small.setup({"w": torch.zeros(1000)})  # what fits still works
        job = small.snapshot(0, {"w": torch.ones(1000)})
        assert job.done.wait(10) and job.ok and small.agreed_step == 0
        small.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- end to end: 4 ranks, 2 nodes, one holder directory per node --------------------------------------
def job(tmp_path: Path, *args: str, run_id: str, timeout: float = 240) -> list[dict]:
    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}.jsonl"
    cmd = [sys.executable, str(REPO / "tests" / "workers" / "forkrun.py"), "--nproc", "4",
           str(REPO / "tests" / "workers" / "memory_job.py"), "--holders", str(tmp_path / "holders"),
           "--run-id", run_id, "--snapshot-dir", str(tmp_path / "snaps"), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return sorted(rows, key=lambda x: x["rank"]), r


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run every restore must equal bitwise: run once per test session and
    shared by the xdist workers (conftest.made_once), so these tests spread over the workers."""
    def make(d: Path) -> None:
        rows, r = job(d, "--steps", "12", "--memory-interval-steps", "0", run_id="ref")
        assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-2000:]
        (d / "reference.json").write_text(json.dumps(rows[0]))

    return json.loads((made_once(tmp_path_factory, "memory-reference", make) / "reference.json").read_text())


CRASH_RUN = "crash"


@pytest.fixture(scope="session")
def crashed(tmp_path_factory) -> Path:
    """The job crashed after step 6 (every rank at once, os._exit, nothing cleaned up; disk
    snapshot of step 3, memory of steps 5 and 6 with their replicas): made once per session and
    shared (conftest.made_once). Each test resumes from its own copy, after doing its damage."""
    def make(d: Path) -> None:
        rows, r = job(d, "--steps", "12", "--exit-at", "6", "--interval-steps", "4", run_id=CRASH_RUN)
        assert rows == [] and r.returncode != 0, r.stderr[-2000:]

    return made_once(tmp_path_factory, "memory-crashed", make)


@pytest.fixture(scope="session")
def finished(tmp_path_factory) -> Path:
    """The job run to its end (12 steps, disk snapshots of 3, 7 and 11, memory of 11): made once
    per session and shared; each test restores from its own copy."""
    def make(d: Path) -> None:
        rows, r = job(d, "--steps", "12", "--interval-steps", "4", run_id=CRASH_RUN)
        assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-2000:]
        assert (d / "snaps" / "step-000000011").is_dir()  # disk: 3, 7 and 11 (close writes the last)

    return made_once(tmp_path_factory, "memory-finished", make)


def copy_of(made: Path, tmp_path: Path) -> None:
    """A test's own copy of a shared job's holders and snapshots (modes kept: a holder is 0700)."""
    import shutil

    for name in ("holders", "snaps"):
        shutil.copytree(made / name, tmp_path / name, symlinks=True)


def crash_then_resume(tmp_path: Path, crashed: Path, *, between=None, resume_run_id: str = CRASH_RUN):
    copy_of(crashed, tmp_path)
    if between:
        between(tmp_path / "holders")
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "4", run_id=resume_run_id)
    assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-3000:]
    return rows, r


@pytest.mark.slow
def test_crash_restores_from_own_memory_bitwise_equal(tmp_path, reference, crashed):
    rows, _ = crash_then_resume(tmp_path, crashed)
    # The crash (os._exit right after step 6) may land while step 6's replica is still copying:
    # then the newest agreed memory snapshot is step 5 and one step is recomputed, never more.
    assert len({row["start"] for row in rows}) == 1
    for row in rows:
        assert row["start"] in (6, 7) and row["resumed_from"] == f"memory:step-{row['start'] - 1:09d}"
        assert row["restore"]["tier"] == "memory" and row["restore"]["own"] == [0, 1, 2, 3] and row["restore"]["peer"] == []
    assert rows[0]["params"] == reference["params"] and rows[0]["optim"] == reference["optim"]


@pytest.mark.slow
def test_a_lost_node_s_shards_are_pulled_from_the_peer_replica_bitwise_equal(tmp_path, reference, crashed):
    import shutil

    rows, _ = crash_then_resume(tmp_path, crashed, between=lambda h: shutil.rmtree(h / "node1"))
    # at most one step lost to the crash (step 6's copy may still have been in flight)
    assert {r["restore"]["tier"] for r in rows} == {"memory"} and rows[0]["start"] in (6, 7)
    assert rows[0]["restore"]["own"] == [0, 1] and rows[0]["restore"]["peer"] == [2, 3]
    assert rows[0]["params"] == reference["params"] and rows[0]["optim"] == reference["optim"]
    assert rows[0]["memory"]["replica_errors"] == 0 and rows[0]["memory"]["agreed_step"] >= 10  # 11 may still be copying


@pytest.mark.slow
def test_both_copies_lost_falls_back_to_disk_and_says_so(tmp_path, reference, crashed):
    import shutil

    def wipe(h):
        shutil.rmtree(h / "node0")
        shutil.rmtree(h / "node1")

    rows, r = crash_then_resume(tmp_path, crashed, between=wipe)
    assert rows[0]["restore"]["tier"] == "disk" and rows[0]["start"] == 4  # disk snapshot at step 3
    assert rows[0]["resumed_from"].endswith("step-000000003")
    assert rows[0]["params"] == reference["params"]


@pytest.mark.slow
def test_a_shard_lost_from_memory_is_read_alone_from_the_disk_snapshot_of_the_same_step(tmp_path, reference, finished):
    """Node 1 and every replica of its shards are gone (two adjacent nodes failed), but the newest
    disk snapshot is of the newest memory step: ranks 2 and 3 read their own parts of it, without
    a collective load, while ranks 0 and 1 restore from node 0's memory — bitwise equal."""
    copy_of(finished, tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "holders" / "node1")
    for replica in (tmp_path / "holders" / "node0").glob("replica-*.mem"):
        replica.unlink()
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "4", run_id=CRASH_RUN)
    assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-3000:]
    for row in rows:
        assert row["start"] == 12 and row["resumed_from"] == "memory:step-000000011", row
        assert row["restore"]["tier"] == "memory" and row["restore"]["own"] == [0, 1] and row["restore"]["disk"] == [2, 3]
    assert rows[0]["params"] == reference["params"] and rows[0]["optim"] == reference["optim"]


@pytest.mark.slow
def test_an_unreadable_disk_part_sends_every_rank_to_the_previous_disk_snapshot(tmp_path, reference, finished):
    """The same loss, but the lost shards' part of the disk snapshot is damaged: no rank keeps a
    half-restored state — all fall back together, the damaged snapshot is set aside, and the job
    resumes from the one before, recomputing the steps since (bitwise equal at the end)."""
    copy_of(finished, tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "holders" / "node1")
    for replica in (tmp_path / "holders" / "node0").glob("replica-*.mem"):
        replica.unlink()
    damaged = sorted((tmp_path / "snaps" / "step-000000011").glob("__2_*.distcp"))
    assert damaged
    for part in damaged:
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "4", run_id=CRASH_RUN)
    assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-3000:]
    for row in rows:
        assert row["start"] == 8 and row["restore"]["tier"] == "disk", row
        assert row["resumed_from"].endswith("step-000000007")
    assert "cannot read this rank's part" in rows[2]["restore"]["memory_reason"]
    assert rows[0]["restore"]["memory_reason"] == "the restore from memory failed on another rank"
    assert any(p.name.startswith("step-000000011") and p.name != "step-000000011" for p in (tmp_path / "snaps").iterdir())
    assert rows[0]["params"] == reference["params"] and rows[0]["optim"] == reference["optim"]


@pytest.mark.slow
def test_a_torn_replica_is_never_loaded(tmp_path, reference, crashed):
    """Node 1 is lost and node 0's newest replica of its shards was torn (its sender died
    mid-copy): the previous complete replica is used, one step older."""
    import shutil
    import struct

    def tear(h):
        shutil.rmtree(h / "node1")
        for shard in (2, 3):
            slots = []
            for i in (0, 1):
                p = h / "node0" / slot_name(REPLICA, shard, i)
                raw = p.read_bytes()[:24]
                slots.append((struct.unpack("<q", raw[16:24])[0], p))
            newest = max(slots)[1]
            with open(newest, "r+b") as f:  # state word back to WRITING, as a copy cut off midway leaves it
                f.seek(12)
                f.write(struct.pack("<I", WRITING))

    rows, _ = crash_then_resume(tmp_path, crashed, between=tear)
    assert rows[0]["restore"]["tier"] == "memory" and rows[0]["start"] == 6  # step 5, not 6
    assert rows[0]["restore"]["memory_rejected"]["torn"] == 2
    assert rows[0]["params"] == reference["params"]


@pytest.mark.slow
def test_stale_memory_from_an_older_run_is_rejected(tmp_path, reference, crashed):
    rows, _ = crash_then_resume(tmp_path, crashed, resume_run_id="new-run")
    assert rows[0]["restore"]["tier"] == "disk" and rows[0]["start"] == 4
    assert rows[0]["restore"]["memory_rejected"]["stale_run"] > 0
    assert rows[0]["params"] == reference["params"]


def _holder_ids(d: str, barrier, q) -> None:
    from trainer.memory import holder_id
    barrier.wait(30)  # all at once, as the ranks of a node starting together
    try:
        q.put(holder_id(Path(d)))
    except MemoryTierError as exc:
        q.put(f"error: {exc}")


def test_ranks_racing_to_create_the_holder_id_all_read_the_same_whole_id(tmp_path):
    """Every rank of a node calls holder_id at once; none may read a half-written id (it was
    created empty and written after: 'is not a holder id', about 1 in 10 races here)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for attempt in range(40):
        d = tmp_path / f"h{attempt}"
        ensure_holder(d)
        q, barrier = ctx.Queue(), ctx.Barrier(6)
        procs = [ctx.Process(target=_holder_ids, args=(str(d), barrier, q)) for _ in range(6)]
        for p in procs:
            p.start()
        ids = {q.get(timeout=60) for _ in procs}
        for p in procs:
            p.join(30)
        assert len(ids) == 1 and len(next(iter(ids))) == 24, ids
        assert sorted(os.listdir(d)) == ["holder-id"]  # no temporary file left behind


def committed_steps(snaps: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in snaps.glob("step-*") if p.name[5:].isdigit() and (p / "COMMITTED").is_file())


def resume_from_disk_only(tmp_path: Path, run_id: str) -> list[dict]:
    """Wipe every node's memory and run the job again to its end: it resumes from the newest disk
    snapshot, so its final state is that snapshot's (nothing left to train when it is the last)."""
    import shutil

    shutil.rmtree(tmp_path / "holders")
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "3", run_id=run_id)
    assert len(rows) == 4, r.stdout[-2000:] + r.stderr[-3000:]
    return rows


@pytest.mark.slow
def test_a_partner_that_never_keeps_up_makes_memory_snapshots_late_not_the_step_nor_the_disk(tmp_path, reference):
    """Rank 2's replica copies are held until training ends (--hold-copies): from step 0 on, a copy
    is always running. Every later memory snapshot is late, and training goes on to its last step
    regardless (it would block forever if a step waited for the copy). The disk snapshots (due at
    2, 5, 8, 11) are no longer put off until a copy ends (it used to be never for the one due at
    the end): each is staged for the disk tier on its own, the one due at 11 is written at 11, and
    it restores bitwise. Merged (#29): test_a_slow_partner_makes_memory_snapshots_late_not_the_step
    and test_a_disk_snapshot_due_while_a_replica_copy_runs_is_written_at_its_step, whose counts
    depended on how fast this host ran the steps against a throttled copy."""
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "3", "--slow-rank", "2", "--hold-copies",
                  "--slow-bytes-per-second", "2e6", "--step-seconds", "0.02", run_id="due-busy")
    assert len(rows) == 4, r.stderr[-3000:]
    for row in rows:
        mem = row["memory"]
        assert (mem["snapshots"], mem["late"]) == (1, 11), mem  # step 0's copy ran through every later step
        assert mem["disk_only"] >= 2 and mem["replica_errors"] == 0 and mem["agreed_step"] == 0, mem
    disk = [rec["step"] for rec in rows[0]["records"] if rec["tier"] == "disk" and rec["ok"]]
    assert disk[0] == 2 and disk[-1] == 11 and disk == sorted(set(disk)), rows[0]["records"]
    assert committed_steps(tmp_path / "snaps")[-1] == 11
    again = resume_from_disk_only(tmp_path, "due-busy-2")
    assert again[0]["restore"]["tier"] == "disk" and again[0]["start"] == 12
    assert again[0]["params"] == reference["params"] and again[0]["optim"] == reference["optim"]


@pytest.mark.slow
def test_the_disk_snapshot_owed_at_the_end_is_written_by_close(tmp_path, reference):
    """Disk every 3 steps on a filesystem that stalls (the first write, step 2's, is held until
    training ends: --hold-disk-step, not a slower write, which a loaded host's slow steps outlasted
    once; and not step 8's, which under two suites could start late, at step 9 or 10, when step
    5's write was still running at step 8, so step 11 found no write running): every later one
    due, step 11's last, finds that write still running, so it is owed when training ends; close()
    writes it from memory (it used to be lost). It restores bitwise."""
    rows, r = job(tmp_path, "--steps", "12", "--interval-steps", "3", "--hold-disk-step", "2", run_id="owed-end")
    assert len(rows) == 4, r.stderr[-3000:]
    assert {row["memory"]["flushed_at_close"] for row in rows} == {11}
    assert any(rec["step"] == 11 and rec["tier"] == "disk" and rec["ok"] for rec in rows[0]["records"])
    assert committed_steps(tmp_path / "snaps")[-1] == 11
    again = resume_from_disk_only(tmp_path, "owed-end-2")
    assert again[0]["restore"]["tier"] == "disk" and again[0]["start"] == 12
    assert again[0]["params"] == reference["params"] and again[0]["optim"] == reference["optim"]


def test_the_reused_state_dict_follows_the_training_and_an_lr_schedule(tmp_path):
    """The memory tier reuses the state dict of an (unsharded) model + optimizer while its tensors
    are the live ones; every snapshot must still hold the step's parameters, optimizer state and
    learning rate (a scheduler changes it each step). A fresh guard restores exactly those."""
    from sentinel.channel import NullEndpoint
    from trainer.guard import ModelOptimState, SnapshotGuard

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
        return model, optim, sched

    def train(model, optim, sched, step):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()

    kw = dict(memory_interval_steps=1, memory_dir=tmp_path / "holder", memory_run_id="reuse", endpoint=NullEndpoint())
    model, optim, sched = make()
    guard = SnapshotGuard(tmp_path / "snaps", {"app": ModelOptimState(model, optim)}, **kw)
    for step in range(6):
        train(model, optim, sched, step)
        guard.step(step)
        assert guard.memory.wait_idle()
    assert guard.memory_summary()["snapshots"] == 6 and guard.memory.agreed_step == 5
    want_params = [p.detach().clone() for p in model.parameters()]
    want_avg = [optim.state[p]["exp_avg"].clone() for p in model.parameters()]
    assert optim.param_groups[0]["lr"] == 0.1 * 0.5 ** 6
    guard.close(flush=False)

    model2, optim2, sched2 = make()
    guard2 = SnapshotGuard(tmp_path / "snaps", {"app": ModelOptimState(model2, optim2)}, **kw)
    assert guard2.resume() == 6 and guard2.restore_summary()["tier"] == "memory"
    assert all(torch.equal(a, b) for a, b in zip(want_params, model2.parameters()))
    assert all(torch.equal(a, optim2.state[p]["exp_avg"]) for a, p in zip(want_avg, model2.parameters()))
    assert optim2.param_groups[0]["lr"] == 0.1 * 0.5 ** 6
    # after the load the live tensors are others: the next snapshot rebuilds and still follows them
    train(model2, optim2, sched2, 6)
    guard2.step(6)
    assert guard2.memory.wait_idle() and guard2.memory.agreed_step == 6
    guard2.close(flush=False)


def test_migrate_ack_mode_is_checked(tmp_path):
    """A migrate snapshot is acknowledged once durable unless the job opts into memory-only acks;
    any other spelling is refused before anything starts."""
    from trainer.guard import SnapshotGuard
    with pytest.raises(ValueError, match="migrate_ack must be 'durable' or 'memory'"):
        SnapshotGuard(tmp_path, {}, memory_interval_steps=1, migrate_ack="fast")


def test_a_leaving_node_is_exposed_only_when_its_replica_holder_leaves_too():
    from trainer.memory.plan import nodes_left_without_a_copy

    ring = [1, 2, 0]  # node n's replicas on node n + 1
    assert nodes_left_without_a_copy(ring, {1, 2}) == [1]  # node 1's copy is on node 2, leaving too
    assert nodes_left_without_a_copy(ring, {1}) == [] and nodes_left_without_a_copy([1, 0], {0, 1}) == [0, 1]
    assert nodes_left_without_a_copy([0], {0}) == [0]  # one node: its memory is the only copy


def test_placed_partners_follow_the_node_plan_and_default_to_the_ring():
    from trainer.memory.plan import placed_partners

    # node n's replicas on holder[n]: node 0 -> 2, 1 -> 0, 2 -> 3, 3 -> 1 (two ranks per node)
    holder = [2, 0, 3, 1]
    assert [placed_partners(r, 8, 2, holder) for r in range(8)] == [
        (4, 2), (5, 3), (0, 6), (1, 7), (6, 0), (7, 1), (2, 4), (3, 5)]
    ring = [(n + 1) % 4 for n in range(4)]
    assert [placed_partners(r, 8, 2, ring) for r in range(8)] == [ring_partners(r, 8, 2) for r in range(8)]


# -- #47 item 3: nodes that leave together with every copy of a shard ---------------------------------
def test_a_migration_taking_every_holder_of_a_shard_is_acknowledged_once_on_disk(tmp_path):
    """With ``migrate_ack="memory"`` a node may go once its migrate snapshot is in memory and
    replicated. Two nodes holding each other's replicas (the ring of two) asked to migrate together
    would leave with both copies: their committed acks (what lets each daemon drain its node) must
    wait for the disk copy. One node asked alone leaves a copy of every shard on the other: its
    memory ack stands."""
    from conftest import register_agent, wait_for
    from sentinel.daemon_endpoint import DaemonEndpoint
    from trainer.disk import MARKER

    runtime, snaps, out = tmp_path / "run", tmp_path / "snaps", tmp_path / "out.jsonl"
    register_agent(runtime)  # this test is the agent: forkrun's ranks descend from it
    daemon = DaemonEndpoint(runtime)
    cmd = [sys.executable, str(REPO / "tests" / "workers" / "forkrun.py"), "--nproc", "4",
           str(REPO / "tests" / "workers" / "memory_job.py"), "--holders", str(tmp_path / "holders"), "--run-id", "adj",
           "--snapshot-dir", str(snaps), "--out", str(out), "--steps", "100000", "--step-seconds", "0.05",
           "--slow-disk-seconds", "1.0", "--migrate-ack", "memory", "--migrate-hold-seconds", "0.5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SENTINEL_RUNTIME_DIR": str(runtime)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                            start_new_session=True)
    got: list = []

    def committed(rid: str, n: int):
        got.extend(a for a in daemon.poll_acks() if a.phase == "committed")
        mine = [a for a in got if a.id == rid]
        return mine if len(mine) == n else None

    try:
        wait_for(lambda: len(daemon.rank_pids()) == 4, 240, what="4 rank sockets")
        daemon.request("snapshot", "who", "")
        rank_of = {a.pid: a.rank for a in wait_for(lambda: committed("who", 4), 120, what="the ranks' snapshot acks")}
        node1 = [pid for pid, rank in rank_of.items() if rank >= 2]  # ranks 2, 3: the second "node"
        daemon.request("migrate", "one", "", pids=node1)
        one = wait_for(lambda: committed("one", 2), 120, what="node 1's migrate acks")
        assert all(a.ok and a.path.startswith("memory:") for a in one), one  # node 0 keeps a copy of every shard
        wait_for(lambda: (snaps / f"step-{one[0].step:09d}" / MARKER).exists(), 60, what="its disk copy")
        time.sleep(1.0)  # the 0.5 s hold is over: the next request is a migration of its own
        daemon.request("migrate", "both", "")
        seen = []
        for a in wait_for(lambda: committed("both", 4), 120, what="both nodes' migrate acks"):
            seen.append((a.step > one[0].step, a.ok, a.path.startswith("memory:")))
        on_disk = [(snaps / f"step-{a.step:09d}" / MARKER).exists() for a in got if a.id == "both"]
        assert seen == [(True, True, False)] * 4 and all(on_disk), (seen, on_disk)  # acked once durable
    finally:
        os.killpg(proc.pid, 9)  # forkrun and its ranks: the job never ends on its own
        proc.wait(timeout=30)
        daemon.close()


def test_a_round_skipped_under_the_replica_budget_still_takes_the_own_copy_which_restores(tmp_path, monkeypatch):
    """SENTINEL_MEMORY_REPLICA_BUDGET: after a round, the next waits out its pause; a memory
    snapshot due meanwhile skips the round (counted, in the metrics file) but its own copy is
    staged and complete, and a restart in place restores that newest step exactly."""
    monkeypatch.setenv("SENTINEL_MEMORY_REPLICA_BUDGET", "0.5")
    tier = MemoryTier(tmp_path / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
    live = {"w": torch.arange(1000, dtype=torch.float32)}
    tier.setup(live)
    assert tier.snapshot(0, live).done.wait(10) and tier.agreed_step == 0
    assert tier.replicator._ready_at >= time.monotonic() - 1  # the pause after round 0 is set from its length
    tier.replicator._ready_at = time.monotonic() + 60  # round 0 was long: the pause is still on
    assert tier.replica_wait()
    live["w"].add_(1)
    slot = tier.take(1, live, due=True, replicate=not tier.replica_wait(), disk=False)
    assert slot is not None and (tier.replica_skipped, tier.late, tier.agreed_step) == (1, 0, 0)
    assert slot.header()[:2] == (COMPLETE, 1)
    tier._write_metrics()
    assert 'sentinel_trainer_memory_replica_skipped_total{rank="0"} 1' in tier.metrics_file.read_text()
    want = live["w"].clone()
    tier.close()
    again = MemoryTier(tmp_path / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
    fresh = {"w": torch.zeros(1000)}
    got = again.restore(lambda: fresh, -1)
    assert (got.tier, got.step) == ("memory", 1) and torch.equal(fresh["w"], want)
    again.close()


def test_the_copy_taken_while_the_ranks_agree_is_the_one_replicated_or_kept_as_the_own_copy(tmp_path):
    """The guard stages a due step's own copy before the agreement is known (trainer.guard_memory):
    handed over, it is that very slot that is replicated (no second copy); found late, it stays a
    complete own copy of its step, and the agreed copy is never the slot offered next."""
    tier = MemoryTier(tmp_path / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
    live = {"w": torch.arange(1000, dtype=torch.float32)}
    tier.setup(live)
    early = tier.stage(0, live)
    slot = tier.take(0, live, due=True, replicate=True, disk=False, staged=early)
    assert slot is early and tier.snapshots == 1 and len(tier.stalls) == 1  # copied once
    assert tier.wait_idle() and tier.agreed_step == 0
    live["w"].add_(1)
    early = tier.stage(1, live)
    assert tier.take(1, live, due=True, replicate=False, disk=False, staged=early) is None
    assert (tier.late, tier.snapshots, tier.agreed_step) == (1, 1, 0)
    assert early.header()[:2] == (COMPLETE, 1)
    assert tier.free_slot() is not None and tier.free_slot() is not tier.replicator.agreed_slot
    disk = tier.take(2, live, due=True, replicate=False, disk=True, staged=tier.stage(2, live))
    assert disk is not None and disk.header()[:2] == (COMPLETE, 2) and tier.disk_only == 1
    tier.close()


@pytest.mark.parametrize("raw", ["1", "-0.1", "x"])
def test_a_replica_budget_outside_zero_to_one_is_refused_naming_the_variable(tmp_path, monkeypatch, raw):
    monkeypatch.setenv("SENTINEL_MEMORY_REPLICA_BUDGET", raw)
    with pytest.raises(MemoryTierError, match="SENTINEL_MEMORY_REPLICA_BUDGET"):
        MemoryTier(tmp_path / "h", run_id="r", rank=0, world=1, local_world=1, group=None)
