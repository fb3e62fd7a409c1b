"""The drill's scheduler host (sentinel_tools.drill_scheduler, `--hosts netns`): a daemon's spare
call posts to it with the job's token; without the token it is refused and nothing is claimed; a
spare is claimed once; an unreachable scheduler is a failure that says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from sentinel_tools.ports import free_port

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture
def scheduler(tmp_path):
    pool = tmp_path / "pool"
    pool.mkdir()
    token = tmp_path / "token"
    token.write_text("s3cret")
    token.chmod(0o600)
    port = free_port()
    log = open(tmp_path / "scheduler.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "sentinel_tools.drill_scheduler", "serve", "--address", "127.0.0.1",
                          "--port", str(port), "--pool", str(pool), "--token-file", str(token)],
                         stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
    end = time.monotonic() + 60
    while "scheduler listening" not in (tmp_path / "scheduler.log").read_text():
        assert p.poll() is None and time.monotonic() < end, (tmp_path / "scheduler.log").read_text()
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", pool, token
    finally:
        p.kill()
        p.wait()
        log.close()


def claim(url: str, token: Path, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sentinel_tools.drill_scheduler", "claim", "--url", url, "--for", "node1",
                           "--token-file", str(token), "--timeout", str(timeout)],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=REPO)


def cold_spare(pool: Path, tmp_path: Path) -> Path:
    started = tmp_path / "started"
    (pool / "spare0.json").write_text(json.dumps({
        "name": "spare0", "argv": [sys.executable, "-c", f"open({str(started)!r}, 'w').write('up')"], "env": ENV,
        "log": str(tmp_path / "spare0.log"), "cwd": str(REPO), "warm": False, "pidfile": str(tmp_path / "none.pid")}))
    (pool / "spare0.free").write_text("")
    return started


def test_a_call_without_the_token_is_refused_and_claims_nothing(scheduler, tmp_path):
    url, pool, _ = scheduler
    cold_spare(pool, tmp_path)
    wrong = tmp_path / "wrong"
    wrong.write_text("guess")
    r = claim(url, wrong)
    assert r.returncode == 1 and "refused: 403" in r.stderr
    assert (pool / "spare0.free").exists() and not (pool / "spare0.claimed").exists()


def test_a_spare_is_claimed_once_and_started(scheduler, tmp_path):
    url, pool, token = scheduler
    started = cold_spare(pool, tmp_path)
    r = claim(url, token)
    assert r.returncode == 0 and "started spare spare0" in r.stdout, r.stderr
    assert (pool / "spare0.claimed").exists() and not (pool / "spare0.free").exists()
    end = time.monotonic() + 60
    while not started.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert started.read_text() == "up"
    again = claim(url, token)
    assert again.returncode == 1 and "no free spare in the pool" in again.stderr


def test_an_unreachable_scheduler_is_a_failure_that_says_so(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret")
    r = claim(f"http://127.0.0.1:{free_port()}", token, timeout=5)
    assert r.returncode == 1 and "cannot be reached" in r.stderr
