"""Sentinel under a stock Lightning job (trainer.integrations.lightning, examples/lightning_job.py):
the script is Lightning's own but for ``callbacks=[..., SentinelCallback(...)]``.

* Resumed at a step in the middle of an epoch (the plain DataLoader moved forward) and at an
  epoch's last step (before its validation loop), the final parameters and optimizer state are
  bitwise equal to an uninterrupted run's; Lightning's ModelCheckpoint keeps writing beside it.
* ``sentinel drill --trainer lightning``: an Xid 79 hands the failed node's rank to the warm spare
  with 0 recomputed steps, and a kill -9 of a node loses at most one step (0 here: the memory
  tier), both bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning  # noqa: F401 - the test extra installs it: a missing one fails here, never skips
import pytest

from conftest import REPO, job_launcher, session_shared_dir
from test_drill import drill, why

pytestmark = [pytest.mark.needs_torch, pytest.mark.slow]

JOB = REPO / "examples" / "lightning_job.py"
# 16 optimizer steps an epoch at world size 2: two epochs and a half, two validation loops. The drills
# run as many (their fault comes at step 25), so that one uninterrupted run is every test's reference
STEPS = 40


def run_job(root: Path, max_steps: int, *, interval: int = 1, forked: bool = False) -> dict:
    """The stock script on 2 processes to ``max_steps``, under plain torchrun (or, ``forked``, as
    two forks of one interpreter that imported Lightning once: conftest.job_launcher); its final
    digests."""
    final = root / f"final-{max_steps}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SENTINEL_FINAL_FILE": str(final),
           "SENTINEL_INTERVAL_STEPS": str(interval)}
    env.pop("SENTINEL_PROGRESS_FILE", None)
    r = subprocess.run([*job_launcher(2, forked=forked), str(JOB),
                        "--max-steps", str(max_steps), "--devices", "2", "--root", str(root / "run")],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(final.read_text())


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> Path:
    """The drills' --reference-cache, shared with the resume test below: one uninterrupted run of
    the job at world size 2 and STEPS steps serves the whole session."""
    return session_shared_dir(tmp_path_factory, "lightning-drill-references")


def uninterrupted(references: Path) -> dict:
    """The job's STEPS steps without a stop: the run the drills' --verify compares with (the same
    script, world size and step count under plain torchrun; Sentinel's snapshots never change what
    is trained), made by whichever test asks first (sentinel_tools.drill_report.cached_reference)."""
    from sentinel_tools.drill_report import cached_reference

    want, error = cached_reference(references, 2, STEPS, lambda d: (run_job(d, STEPS), ""), job="lightning")
    assert want is not None, error
    return want


def test_a_stock_lightning_job_resumed_twice_across_an_epoch_end_is_bitwise_equal(tmp_path, references):
    """Stopped after step 15 (the last of epoch 0: never a snapshot, SentinelCallback says why), it
    resumes from step 14's at step 15 (the plain DataLoader moved past 15 batches), runs epoch 0's
    validation and into epoch 1, stops after step 20, resumes again at batch 5 of epoch 1: the
    parameters and optimizer state at the end are the uninterrupted run's, bit for bit. The
    reference runs under plain torchrun; the three stopped and resumed runs, whose subject is the
    resume, not the launcher, are forks (the drills below start the job through the elastic agent)."""
    want = uninterrupted(references)
    root = tmp_path / "resumed"
    first = run_job(root, 16, forked=True)
    kept = snapshot_steps(root)
    assert {13, 14} <= kept and 15 not in kept, kept
    second = run_job(root, 21, forked=True)
    got = run_job(root, STEPS, forked=True)
    assert (first["resumed_at"], second["resumed_at"], got["resumed_at"]) == (0, 15, 21)
    assert got["params"] == want["params"] and got["optim"] == want["optim"]
    assert got["guard"]["resumed_from"].endswith("step-000000020")
    # Lightning's own periodic checkpoints, every 10 steps, beside Sentinel's snapshots
    saved = sorted(p.name for p in (root / "run" / "checkpoints").glob("*.ckpt"))
    assert saved == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "epoch=1-step=30.ckpt", "epoch=2-step=40.ckpt"]


def snapshot_steps(root: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in (root / "run" / "sentinel").glob("step-*")}


def test_xid79_hands_a_lightning_job_to_the_spare_with_no_lost_step_and_bitwise_equal_result(references):
    r = drill("--trainer", "lightning", "--fault", "xid79", "--steps", str(STEPS), "--verify", references=references)
    assert r["rc"] == 0 and r["ok"], why(r)
    assert r["recomputed_steps"] == [] and r["spare_in_place"] and "spare0" in r["final_nodes"]
    assert r["verify"]["bitwise_equal"], why(r)
    assert [s["kind"] for s in r["snapshots"] if s["kind"] == "migrate"] == ["migrate"]


def test_kill_of_a_lightning_node_loses_at_most_one_step_and_ends_bitwise_equal(references):
    r = drill("--trainer", "lightning", "--fault", "kill", "--steps", str(STEPS), "--verify", references=references)
    assert r["rc"] == 0 and r["ok"], why(r)
    assert len(r["recomputed_steps"]) <= 1 and r["spare_in_place"], why(r)
    assert r["restore"]["tier"] == "memory", why(r)
    assert r["verify"]["bitwise_equal"], why(r)


def test_drill_refuses_a_fault_the_lightning_job_cannot_take():
    r = subprocess.run([sys.executable, "-m", "sentinel", "drill", "--trainer", "lightning", "--fault", "hang"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "--trainer lightning runs --fault kill, xid79 only" in r.stderr
