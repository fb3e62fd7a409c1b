"""Sentinel through TorchTitan's own checkpoint manager (trainer.integrations.torchtitan), on CPU:
torchtitan 0.3.0's CheckpointManager (Sentinel's subclass), OptimizersContainer,
LRSchedulersContainer and ParallelAwareDataloader drive our FSDP2 transformer on gloo
(examples/torchtitan_job.py; why not torchtitan.train itself: docs/integrations.md).

* Stopped after step 17 and restarted, the job resumes through torchtitan's own load path from
  its periodic checkpoint (step 15), and ends bitwise equal to an uninterrupted run, in torchtitan's
  synchronous and async save modes.
* ``sentinel drill --trainer torchtitan``: an Xid 79 makes torchtitan's manager save the current
  step at once; the spare loads it through torchtitan's ``_load``: 0 recomputed steps, bitwise.
  A kill -9 resumes from torchtitan's last periodic checkpoint (no memory tier): at most its
  interval, bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torchtitan  # noqa: F401 - the test extra installs it: a missing one fails here, never skips

from conftest import REPO, job_launcher, made_once, session_shared_dir
from test_drill import drill, why

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]

JOB = REPO / "examples" / "torchtitan_job.py"


def run_job(root: Path, *, stop_after: int = 0, async_mode: str = "async", forked: bool = False) -> dict:
    """The job on 2 ranks under plain torchrun (or, ``forked``, as two forks of one interpreter that
    imported torchtitan once: conftest.job_launcher); its final digests."""
    final = root / f"final-{stop_after}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SENTINEL_FINAL_FILE": str(final)}
    env.pop("SENTINEL_PROGRESS_FILE", None)
    r = subprocess.run([*job_launcher(2, forked=forked), str(JOB),
                        "--steps", "25", "--interval", "5", "--stop-after", str(stop_after), "--async-mode", async_mode,
                        "--root", str(root / "run")], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(final.read_text()) if final.exists() else {}


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> dict:
    """The job's 25 steps without a stop, once per session for both save modes: the mode changes
    how checkpoints are written, never what is trained (each test's restarted run saves and loads
    in its own mode). Shared by the xdist workers (conftest.made_once)."""
    def make(d: Path) -> None:
        (d / "final.json").write_text(json.dumps(run_job(d, async_mode="disabled")))

    return json.loads((made_once(tmp_path_factory, "torchtitan-uninterrupted", make) / "final.json").read_text())


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_restarted_job_resumes_through_torchtitans_load_and_ends_bitwise_equal(tmp_path, async_mode, uninterrupted):
    """The reference runs under plain torchrun; the stopped and the restarted run, whose subject is
    the restart, not the launcher, are forks (the drills below start the job through the agent)."""
    want = uninterrupted
    root = tmp_path / "restarted"
    run_job(root, stop_after=17, async_mode=async_mode, forked=True)
    saved = sorted(int(p.name[5:]) for p in (root / "run" / "checkpoint").glob("step-*") if (p / ".metadata").is_file())
    assert saved[-1] == 15, saved  # torchtitan's own interval (5); step 17 was never saved
    got = run_job(root, async_mode=async_mode, forked=True)
    assert got["resumed_at"] == 16 and got["guard"]["resumed_from"].endswith("step-15")
    assert (got["params"], got["optim"]) == (want["params"], want["optim"])


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> Path:
    return session_shared_dir(tmp_path_factory, "torchtitan-drill-references")


def test_xid79_makes_torchtitan_save_now_and_the_spare_load_it_with_no_lost_step(references):
    r = drill("--trainer", "torchtitan", "--fault", "xid79", "--verify", references=references)
    assert r["rc"] == 0 and r["ok"], why(r)
    assert r["recomputed_steps"] == [] and r["spare_in_place"] and "spare0" in r["final_nodes"]
    migrate = [s for s in r["snapshots"] if s["kind"] == "migrate"]
    loaded = next(e for e in r["timeline"] if e["stage"] == "snapshot loaded")
    # torchtitan's own folder and naming: step-N, N the step the ranks held at
    assert len(migrate) == 1 and loaded["source"].endswith(f"/torchtitan/checkpoint/step-{migrate[0]['step']}")
    assert r["verify"]["bitwise_equal"], why(r)


def test_kill_resumes_from_torchtitans_last_periodic_checkpoint_bitwise(references):
    r = drill("--trainer", "torchtitan", "--fault", "kill", "--interval-steps", "5", "--verify", references=references)
    assert r["rc"] == 0 and r["ok"], why(r)
    # from torchtitan's newest complete periodic checkpoint (every 5 steps; one an async save was still
    # writing at the kill is not complete: the drill's verdict checks that none newer was), exactly the
    # steps after it recomputed
    start = r["restore"]["step"]
    assert r["restore"]["tier"] == "disk" and start % 5 == 0, why(r)
    assert r["recomputed_steps"] == list(range(start + 1, start + 1 + len(r["recomputed_steps"]))), why(r)
    assert r["verify"]["bitwise_equal"], why(r)
