"""Fencing by generation for snapshots (trainer/fence.py, #41 partition): a rank 0 of an older
generation (cut off, replaced, back) has its snapshot commit refused before anything is written,
so its snapshot is never loaded; the generation that resumed from the directory commits. The
store side is in tests/test_slot_rendezvous.py (a cut-off node's heartbeat, leave and shutdown)."""

from __future__ import annotations

import json
import os

import pytest

from trainer.fence import ENV, DirectoryFence, FencedWriteRefused, generation_from_env, token_env

torch = pytest.importorskip("torch")

from trainer.disk import MARKER, DiskTier, complete_snapshots, snapshot_path  # noqa: E402

pytestmark = [pytest.mark.needs_torch]


def save(tier: DiskTier, step: int, value: float) -> str:
    """One snapshot through the disk tier's own path (a copy written in the background, then the
    commit); the commit's error, "" when committed."""
    state = {"w": torch.full((4,), value)}
    return tier.finish(tier.save_copy(step, lambda: state, 16))


def test_a_cut_off_generation_cannot_commit_once_a_newer_one_resumed_and_its_snapshot_is_never_loaded(tmp_path):
    old = DiskTier(tmp_path, group=None, rank=0, world=1, generation=("e1", 3))
    assert save(old, 10, 1.0) == ""  # generation 3 is the job's newest: it commits
    write = old.save_copy(20, lambda: {"w": torch.full((4,), 2.0)}, 16)  # begun, then the link went down
    new = DiskTier(tmp_path, group=None, rank=0, world=1, generation=("e1", 4))  # the job resumed without it
    error = old.finish(write)  # the cut-off rank 0 goes on to commit
    assert error.startswith("commit refused (fenced)") and "generation 4 of this job" in error
    assert not (snapshot_path(tmp_path, 20) / MARKER).exists()
    assert [s for s, _ in complete_snapshots(tmp_path)] == [10]  # what a resume lists: never step 20
    assert save(new, 20, 3.0) == ""
    marker = json.loads((snapshot_path(tmp_path, 20) / MARKER).read_text())
    assert (marker["epoch"], marker["generation"]) == ("e1", 4)
    # the cut-off rank 0 beginning a save at the step the newer generation committed: refused
    # before it unlinks that snapshot's marker
    with pytest.raises(FencedWriteRefused):
        old.save_copy(20, lambda: {"w": torch.zeros(4)}, 16)
    assert [s for s, _ in complete_snapshots(tmp_path)] == [20, 10]
    for t in (old, new):
        t.close()


def test_another_instance_of_the_job_takes_the_directory_and_fences_the_old_one(tmp_path):
    """A job started again (requeued) counts its generations from 1: its epoch tells it apart; the
    old instance's generation 7 is refused though 7 > 1."""
    old = DiskTier(tmp_path, group=None, rank=0, world=1, generation=("first", 7))
    write = old.save_copy(6, lambda: {"w": torch.full((4,), 2.0)}, 16)
    again = DiskTier(tmp_path, group=None, rank=0, world=1, generation=("second", 1))
    assert save(again, 5, 1.0) == ""
    assert "another instance of this job" in old.finish(write)
    with pytest.raises(FencedWriteRefused):
        save(old, 7, 3.0)
    assert [s for s, _ in complete_snapshots(tmp_path)] == [5]
    older_gen = DiskTier(tmp_path, group=None, rank=0, world=1, generation=("second", 1))
    assert older_gen.fence.current() == ("second", 1)  # never lowered, never moved back to the old epoch
    for t in (old, again, older_gen):
        t.close()


def test_without_a_generation_nothing_is_fenced(tmp_path):
    """torch's c10d / etcd-v2 rendezvous give no generation: snapshots commit as before."""
    DirectoryFence(tmp_path, ("e", 9)).raise_to()
    plain = DiskTier(tmp_path, group=None, rank=0, world=1)
    assert save(plain, 1, 1.0) == ""
    assert "generation" not in json.loads((snapshot_path(tmp_path, 1) / MARKER).read_text())
    plain.close()


def test_the_token_from_the_environment_is_validated():
    assert generation_from_env({}) is None
    assert generation_from_env({ENV: token_env("ab12", 5)}) == ("ab12", 5)
    for bad in ("5", "ab/0", "ab/-1", "a b/3", "/3", "ab/x"):
        with pytest.raises(ValueError):
            generation_from_env({ENV: bad})


def test_a_fence_file_that_is_not_a_fence_refuses_rather_than_guesses(tmp_path):
    (tmp_path / "GENERATION").write_text("[]")
    with pytest.raises(FencedWriteRefused):
        with DirectoryFence(tmp_path, ("e", 1)).commit():
            pass
    os.unlink(tmp_path / "GENERATION")
    os.symlink("/etc/hostname", tmp_path / "GENERATION")
    with pytest.raises(FencedWriteRefused):
        DirectoryFence(tmp_path, ("e", 1)).raise_to()


def test_another_user_cannot_stall_the_fence_by_holding_its_lock_file(attacker, shared_tmp):
    """A snapshot directory on shared scratch (1777): another user makes the lock file first and
    holds its flock for good. Before: rank 0's raise_to waited for ever (no snapshot, no resume).
    Now the lock file (or a GENERATION) that is not the job user's is refused at once, loudly."""
    import subprocess
    import threading

    os.chmod(shared_tmp, 0o1777)
    hold = attacker.popen(["python3", "-c", "import fcntl, os, sys, time\n"
                           f"fd = os.open({str(shared_tmp / '.GENERATION.lock')!r}, os.O_RDWR | os.O_CREAT, 0o666)\n"
                           "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(300)"],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        got: list = []

        def raise_fence():
            try:
                got.append(DirectoryFence(shared_tmp, ("e1", 2)).raise_to())
            except FencedWriteRefused as exc:
                got.append(exc)

        t = threading.Thread(target=raise_fence, daemon=True)
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "rank 0 waits for ever on another user's flock"
        assert isinstance(got[0], FencedWriteRefused) and "not trusted" in str(got[0])
        assert not (shared_tmp / "GENERATION").exists()
    finally:
        hold.kill()
        hold.wait()
