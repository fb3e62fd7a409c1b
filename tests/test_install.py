"""`sentinel install`: units, default config and directories in place, idempotently, and never
over an operator's changed config."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from conftest import REPO

BIN = "/usr/bin/true"  # any absolute executable: what the units' ExecStart= will name


def install(root, *args):
    return subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(root), "--bin", BIN, "--no-reload",
                           *args], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


def snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns, stat.S_IMODE(p.stat().st_mode))
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_installs_units_config_and_directories_then_changes_nothing(tmp_path):
    root = tmp_path / "node"
    r = install(root)
    assert r.returncode == 0, r.stderr
    unit = (root / "etc/systemd/system/sentinel.service").read_text()
    shipped = (REPO / "systemd/sentinel.service").read_text()
    assert unit == shipped.replace("/usr/local/bin/sentinel", BIN)
    assert f"ExecStart={BIN} run --config /etc/sentinel/sentinel.toml" in unit
    agent = (root / "etc/systemd/system/sentinel-agent@.service").read_text()
    # the launcher runs isolated; /usr/bin/true has no #! line, so it is this installation's Python
    assert f"ExecStart={sys.executable} -I -m sentinel launch --pidfile /run/sentinel/agent.pid" in agent
    assert (root / "etc/sentinel/sentinel.toml").read_text() == (REPO / "systemd/sentinel.toml").read_text()
    assert stat.S_IMODE((root / "var/lib/sentinel").stat().st_mode) == 0o750
    assert stat.S_IMODE((root / "etc/sentinel").stat().st_mode) == 0o755
    before = snapshot(root)
    r = install(root)
    assert r.returncode == 0 and r.stdout.count(": unchanged") == 3, r.stdout
    assert snapshot(root) == before  # not even rewritten with the same bytes


def test_a_changed_config_is_never_overwritten(tmp_path):
    root = tmp_path / "node"
    assert install(root).returncode == 0
    conf = root / "etc/sentinel/sentinel.toml"
    mine = conf.read_text().replace("lead_time_seconds = 600.0", "lead_time_seconds = 120.0")
    conf.write_text(mine)
    r = install(root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert conf.read_text() == mine
    assert "kept" in r.stdout and "never overwritten" in r.stdout
    assert (root / "etc/sentinel/sentinel.toml.new").read_text() == (REPO / "systemd/sentinel.toml").read_text()
    # a kept config this version would refuse is reported now, not at the next daemon restart
    conf.write_text(mine.replace("[policy]\n", "[policy]\nlead_time = 5\n"))
    r = install(root)
    assert r.returncode == 1 and "policy.lead_time: unknown key" in r.stdout, r.stdout
    assert "lead_time = 5" in conf.read_text()


def test_a_symlink_planted_for_the_config_is_replaced_not_written_through(tmp_path):
    root = tmp_path / "node"
    (root / "etc/sentinel").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (root / "etc/systemd/system").mkdir(parents=True)
    os.symlink(victim, root / "etc/systemd/system/sentinel.service")
    r = install(root)
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious\n"
    assert not (root / "etc/systemd/system/sentinel.service").is_symlink()


def test_bad_arguments_are_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(tmp_path), "--bin", "relative/sentinel",
                        "--no-reload"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "absolute path" in r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(tmp_path), "--bin",
                        str(tmp_path / "missing"), "--no-reload"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not an executable file" in r.stderr
    assert not (tmp_path / "etc").exists()  # nothing written before the arguments were checked


def test_a_command_another_user_can_change_is_never_made_roots_execstart(attacker, shared_tmp):
    """The units run ExecStart= as root: pointing them at a `sentinel` in a user's virtualenv or
    checkout would let that user run code as root. Refused, naming the path; nothing written."""
    venv = shared_tmp / "venv" / "bin"
    venv.mkdir(parents=True)
    os.chown(venv, attacker.uid, attacker.gid)
    script = venv / "sentinel"
    r = attacker.python(f"import os; open({str(script)!r}, 'w').write('#!/bin/sh\\nid\\n'); os.chmod({str(script)!r}, 0o755)")
    assert r.returncode == 0, r.stderr
    root = shared_tmp / "node"
    r = subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(root), "--bin", str(script),
                        "--no-reload"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stdout
    assert "refusing to install: the sentinel command (ExecStart=) would run as root" in r.stderr
    assert str(venv) in r.stderr and f"owned by uid {attacker.uid}" in r.stderr
    assert not (root / "etc/systemd/system/sentinel.service").exists()
    # the same script made root's, in a directory the user can still write: refused too
    os.chown(script, 0, 0)
    r = subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(root), "--bin", str(script),
                        "--no-reload"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and str(venv) in r.stderr, r.stderr


def _root_script(directory, text):
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "sentinel"
    script.write_text(text)
    script.chmod(0o755)
    return script


def _install_bin(root, script, env=None):
    return subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(root), "--bin", str(script),
                           "--no-reload"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_a_root_script_whose_interpreter_another_user_can_change_is_refused(attacker, shared_tmp):
    """The script is root's, in root's directory, but its #! names an interpreter in the user's
    directory (directly, through /usr/bin/env on PATH, or through pip's sh wrapper for long
    paths): root would run the user's program. Refused, naming the interpreter; nothing written."""
    venv = shared_tmp / "venv" / "bin"
    venv.mkdir(parents=True)
    os.chown(venv, attacker.uid, attacker.gid)
    r = attacker.run(["cp", "/usr/bin/python3", str(venv / "python3")])
    assert r.returncode == 0, r.stderr
    bindir = shared_tmp / "rootbin"
    root = shared_tmp / "node"
    cases = {
        "direct": (f"#!{venv}/python3\nfrom sentinel.cli import main\n", {}),
        "env": ("#!/usr/bin/env python3\nfrom sentinel.cli import main\n", {"PATH": f"{venv}:/usr/bin:/bin"}),
        "pip sh wrapper": (f"#!/bin/sh\n\'\'\'exec\' \"{venv}/python3\" \"$0\" \"$@\"\n\' \'\'\'\n", {}),
    }
    for how, (text, env) in cases.items():
        script = _root_script(bindir, text)
        r = _install_bin(root, script, env)
        assert r.returncode == 2, (how, r.stdout)
        assert f"the interpreter of {script} (its #! line) would run as root" in r.stderr, (how, r.stderr)
        assert f"owned by uid {attacker.uid}" in r.stderr or str(venv) in r.stderr, (how, r.stderr)
        assert not (root / "etc/systemd/system/sentinel.service").exists(), how
    # the same script run by root's own Python: installed, and the agent unit's launcher is that Python, isolated
    script = _root_script(bindir, "#!/usr/bin/python3\nfrom sentinel.cli import main\n")
    r = _install_bin(root, script)
    assert r.returncode == 0, r.stderr
    agent = (root / "etc/systemd/system/sentinel-agent@.service").read_text()
    assert "ExecStart=/usr/bin/python3 -I -m sentinel launch --pidfile /run/sentinel/agent.pid" in agent
