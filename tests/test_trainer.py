"""Trainer side, multi-process with gloo through torchrun: agreement, async DCP, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from sentinel.channel import DaemonEndpoint

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]
torch = pytest.importorskip("torch")

from trainer.guard import MARKER, complete_snapshots  # noqa: E402


def torchrun(nproc: int, *args: str, env: dict | None = None, module: str = "trainer.train",
             script: str | None = None, timeout: float = 180, wait: bool = True):
    target = [str(REPO / "tests" / "workers" / script)] if script else ["-m", module]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target, *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def final(path: Path) -> dict:
    return json.loads(path.read_text())


def test_request_reaching_one_rank_snapshots_all_ranks_at_one_step(tmp_path):
    runtime = tmp_path / "run"
    daemon = DaemonEndpoint(runtime)
    snaps = tmp_path / "snaps"
    proc = torchrun(4, "--steps", "400", "--snapshot-dir", str(snaps), "--step-seconds", "0.02",
                    "--migrate-hold-seconds", "1", env={"SENTINEL_RUNTIME_DIR": str(runtime)}, wait=False)
    try:
        pids = wait_for(lambda: (lambda p: p if len(p) == 4 else None)(daemon.rank_pids()), timeout=90, what="4 rank sockets")
        assert daemon.request("snapshot", "req-1", "test: one rank only", pids=[pids[2]]) == 1
        acks = wait_for(lambda: daemon.poll_acks() or None, timeout=60, what="ack")
        ack = acks[0]
        assert ack.id == "req-1" and ack.ok and ack.pid == pids[2] and ack.request_type == "snapshot"
        assert daemon.complete("req-1")
        path = Path(ack.path)
        assert path == snaps / f"step-{ack.step:09d}"
        marker = wait_for(lambda: (path / MARKER).exists() and json.loads((path / MARKER).read_text()), what="marker")
        assert marker["step"] == ack.step and marker["world_size"] == 4
        assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
        assert 0 <= ack.blocked_seconds < 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        daemon.close()


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    r = torchrun(2, "--steps", "20", "--snapshot-dir", str(a / "s"), "--final", str(a / "final.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = torchrun(2, "--steps", "13", "--interval-steps", "5", "--snapshot-dir", str(b / "s"), "--final", str(b / "f1.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s for s, _ in complete_snapshots(b / "s")] == [9, 4]
    r = torchrun(2, "--steps", "20", "--interval-steps", "5", "--snapshot-dir", str(b / "s"), "--final", str(b / "final.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert final(b / "final.json")["resumed_at"] == 10
    assert final(b / "final.json")["params"] == final(a / "final.json")["params"]
    assert final(b / "final.json")["optim"] == final(a / "final.json")["optim"]


@pytest.mark.parametrize("saved,loaded", [(4, 2), (2, 4)])
def test_resume_reshards_across_world_sizes(tmp_path, saved, loaded):
    s = tmp_path / "s"
    r = torchrun(saved, "--steps", "6", "--interval-steps", "6", "--snapshot-dir", str(s), "--final", str(tmp_path / "saved.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    # --steps 6 again: resume at 6 and compute nothing; the state is exactly what was loaded
    r = torchrun(loaded, "--steps", "6", "--snapshot-dir", str(s), "--final", str(tmp_path / "loaded.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = final(tmp_path / "loaded.json"), final(tmp_path / "saved.json")
    assert got["resumed_at"] == 6 and got["world"] == loaded
    assert got["params"] == want["params"] and got["optim"] == want["optim"]


def test_kill_9_mid_async_save_never_loads_the_half_written_snapshot(tmp_path):
    s = tmp_path / "s"
    r = torchrun(2, "--steps", "30", "--interval-steps", "5", "--snapshot-dir", str(s),
                 script="slow_save_then_kill.py", env={"KILL_AT_STEP": "9"}, timeout=120)
    assert r.returncode != 0
    assert (s / "step-000000009").is_dir() and not (s / "step-000000009" / MARKER).exists()
    assert [n for n, _ in complete_snapshots(s)] == [4]
    r = torchrun(2, "--steps", "12", "--snapshot-dir", str(s), "--final", str(tmp_path / "f.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "f.json")["resumed_at"] == 5


def test_corrupt_newest_snapshot_is_skipped_for_the_previous(tmp_path):
    s = tmp_path / "s"
    r = torchrun(2, "--steps", "10", "--interval-steps", "5", "--snapshot-dir", str(s))
    assert r.returncode == 0, r.stderr[-3000:]
    newest = s / "step-000000009"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated, marker still present
    r = torchrun(2, "--steps", "10", "--snapshot-dir", str(s), "--final", str(tmp_path / "f.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert final(tmp_path / "f.json")["resumed_at"] == 5
    assert "could not be loaded" in r.stderr + r.stdout


def test_migrate_hold_is_bounded_and_training_continues(tmp_path):
    runtime = tmp_path / "run"
    daemon = DaemonEndpoint(runtime)
    snaps = tmp_path / "snaps"
    proc = torchrun(2, "--steps", "200", "--snapshot-dir", str(snaps), "--step-seconds", "0.02",
                    "--migrate-hold-seconds", "1.5", "--progress", str(tmp_path / "p.jsonl"), "--final", str(tmp_path / "f.json"),
                    env={"SENTINEL_RUNTIME_DIR": str(runtime)}, wait=False)
    try:
        wait_for(lambda: len(daemon.rank_pids()) == 2, timeout=90, what="rank sockets")
        assert daemon.request("migrate", "mig-1", "test") == 2
        acks = []
        wait_for(lambda: acks.extend(daemon.poll_acks()) or len(acks) == 2, timeout=60, what="2 acks")
        assert {a.step for a in acks} == {acks[0].step} and all(a.ok and a.request_type == "migrate" for a in acks)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        daemon.close()
    steps = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    times = {e["step"]: e["time"] for e in steps if e["event"] == "step"}
    held = times[acks[0].step + 1] - times[acks[0].step]
    assert 1.4 <= held < 10, held  # held about migrate_hold_seconds, then went on
    assert (snaps / f"step-{acks[0].step:09d}" / MARKER).exists()


def test_no_daemon_means_a_null_endpoint(tmp_path):
    from sentinel.channel import NullEndpoint, RankEndpoint

    ep = RankEndpoint.open(tmp_path / "absent")
    assert isinstance(ep, NullEndpoint) and ep.poll() == []
