"""The small things a new user meets first: `sentinel --version`, a missing config that points at
`sentinel install`, `sentinel uncordon` as an ordinary user ends in one clear sentence, never a
traceback (`sentinel scan | head`: tests/test_log_formats.py); `sentinel drill` says on stderr what it is waiting for."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import sentinel
from conftest import SYSTEM_PYTHON
from sentinel import cli
from sentinel_tools import drill, ports

REPO = Path(__file__).resolve().parents[1]


def sentinel_cmd(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sentinel", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, **kw)


def test_version_is_the_package_s():
    r = sentinel_cmd("--version")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (r.returncode, r.stdout) == (0, f"sentinel {sentinel.__version__}\n") and sentinel.__version__ == project


def test_a_missing_config_points_at_sentinel_install(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "etc" / "sentinel.toml"
    monkeypatch.setattr(cli, "DEFAULT_CONFIG", str(missing))
    assert cli.main(["check-config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "cannot read config file" in err and "`sentinel install` writes it" in err
    r = sentinel_cmd("run", "--config", str(tmp_path / "other.toml"))
    assert r.returncode == 2 and "run `sentinel install` for the default one at /etc/sentinel/sentinel.toml" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.needs_root
def test_uncordon_as_an_ordinary_user_is_one_sentence(attacker, shared_tmp):
    import prometheus_client

    libs = shared_tmp / "lib"  # the system interpreter the user runs lacks prometheus_client: lend a readable copy
    shutil.copytree(Path(prometheus_client.__file__).parent, libs / "prometheus_client")
    state = shared_tmp / "state"
    state.mkdir(mode=0o755)
    (state / "cordon.json").write_text(json.dumps({"by": "sentinel"}))
    os.chmod(state / "cordon.json", 0o644)
    for p in [libs, *libs.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    r = attacker.run([SYSTEM_PYTHON, "-m", "sentinel", "uncordon", "--state-dir", str(state)],
                     env={"PYTHONPATH": f"{REPO}:{libs}"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("sentinel: uncordon: permission denied") and "run it as root" in r.stderr
    assert (state / "cordon.json").exists()  # nothing was changed


def test_drill_wait_says_what_it_waits_for_on_stderr():
    """An injected clock: 5 s pass per poll; the sixth poll (at +25 s) succeeds."""
    now = [100.0]
    polls = iter([False] * 5 + [True])
    out = io.StringIO()
    drill.wait(lambda: next(polls), 60, "step 5", clock=lambda: now[0],
               sleep=lambda s: now.__setitem__(0, now[0] + 5), report_every=10, out=out)
    lines = [line.split(": ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == ["waiting for step 5 (up to 60 s)", "still waiting for step 5: 10 s of 60 s",
                     "still waiting for step 5: 20 s of 60 s"]
    out = io.StringIO()
    with pytest.raises(drill.DrillError, match="timed out after 12 s waiting for the spare"):
        drill.wait(lambda: False, 12, "the spare", clock=lambda: now[0],
                   sleep=lambda s: now.__setitem__(0, now[0] + 5), report_every=10, out=out)


def test_picked_ports_are_reserved_host_wide_until_they_go_stale(tmp_path, monkeypatch):
    """Two pickers (other xdist workers, another suite) never hand out the same port while the
    first one's server may still be starting; a reservation older than its lifetime is taken
    again; a directory this user cannot use leaves the pick random."""
    monkeypatch.setattr(ports, "PORT_RESERVATIONS", tmp_path / "reservations")
    first = ports.free_ports(50)
    second = ports.free_ports(50)
    assert len(set(first)) == 50 and not set(first) & set(second)
    held = sorted(p.name for p in (tmp_path / "reservations").iterdir())
    assert held == sorted(str(p) for p in first + second)

    port = first[0]
    assert not ports._reserve(port, time.time())  # held
    assert ports._reserve(port, time.time() + ports.PORT_RESERVATION_SECONDS + 1)  # stale: claimed again
    assert not ports._reserve(port, time.time())

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setattr(ports, "PORT_RESERVATIONS", blocked)
    assert ports._reserve(port, time.time())  # unusable: advisory, the pick goes on
    assert len(ports.free_ports(3)) == 3
