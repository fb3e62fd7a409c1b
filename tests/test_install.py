"""`sentinel install`: units, default config and directories in place, idempotently, and never
over an operator's changed config."""

from __future__ import annotations

import os
import stat
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from sentinel.install import needed_paths

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


# -- the unit must be able to start: nothing it runs may lie where its own sandbox hides ----------
# the test runner's Python when it lives under /root (a pyenv), else a path of that shape
HOME_PYTHON = sys.executable if sys.executable.startswith("/root/") else "/root/.pyenv/versions/3/bin/python3"

def console_script(path, interpreter):
    """What pip writes for `sentinel`: a script whose #! line names the installation's Python."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{interpreter}\nimport sys\nfrom sentinel.cli import main\nsys.exit(main())\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def opt_dir():
    """A root-owned 0755 directory under /opt: where an installation is visible to the units."""
    import shutil
    import tempfile

    os.makedirs("/opt", exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="sentinel-test-", dir="/opt"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def venv_with_sentinel(venv):
    """A venv of the system Python in a root-owned directory, holding a `sentinel` package the unit
    can see (a copy of the package's __init__: the install checks find it, nothing runs it). Not a
    .pth to this checkout: a checkout under /tmp (CI's clones) is hidden from the unit itself."""
    r = subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "sentinel").mkdir()
    shutil.copy(REPO / "sentinel" / "__init__.py", site / "sentinel" / "__init__.py")
    return site


def install_bin(root, script):
    return subprocess.run([sys.executable, "-m", "sentinel", "install", "--root", str(root), "--bin", str(script),
                           "--no-reload"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_an_installation_the_unit_hides_is_refused_with_the_fix(shared_tmp, opt_dir, tmp_path):
    # a `sentinel` under /tmp: PrivateTmp=yes gives the unit an empty /tmp, so ExecStart= would fail (203/EXEC)
    script = console_script(shared_tmp / "venv" / "bin" / "sentinel", "/usr/bin/python3")
    r = install_bin(tmp_path / "node", script)
    assert r.returncode == 2, r.stdout
    assert f"sentinel.service could not start: the sentinel command (ExecStart=) {script} lies under /tmp" in r.stderr
    assert "(PrivateTmp=yes)" in r.stderr and "/opt/sentinel/bin/pip install sentinel-gpu" in r.stderr
    assert not (tmp_path / "node" / "etc").exists()  # nothing written

    # a `sentinel` in /opt whose Python lives under /root (a pyenv, a conda): ProtectHome=yes hides it
    script = console_script(opt_dir / "bin" / "sentinel", HOME_PYTHON)
    r = install_bin(tmp_path / "node", script)
    assert r.returncode == 2, r.stdout
    assert "sentinel.service could not start: its interpreter (#! line) /root/" in r.stderr
    assert "(ProtectHome=yes)" in r.stderr and "BindReadOnlyPaths=/root/" in r.stderr
    assert not (tmp_path / "node" / "etc").exists()


def test_an_installation_the_unit_sees_or_binds_in_is_installed(opt_dir, tmp_path):
    # a venv in /opt from the system Python, whose sentinel package is this checkout: visible
    venv_with_sentinel(opt_dir / "venv")
    script = console_script(opt_dir / "venv" / "bin" / "sentinel", str(opt_dir / "venv" / "bin" / "python3"))
    r = install_bin(tmp_path / "node", script)
    assert r.returncode == 0, r.stderr
    assert f"ExecStart={script} run" in (tmp_path / "node/etc/systemd/system/sentinel.service").read_text()

    # a Python under /root, bound back into the unit by the operator's drop-in: accepted
    script = console_script(opt_dir / "home" / "sentinel", HOME_PYTHON)
    dropin = tmp_path / "node2/etc/systemd/system/sentinel.service.d"
    dropin.mkdir(parents=True)
    top = "/".join(HOME_PYTHON.split("/")[:3])  # /root/.pyenv
    binds = [top]
    # that Python's own `sentinel` may be an editable install of a checkout the unit hides (a CI
    # clone under /tmp): the operator binds it in too, as the refusal's message tells them
    binds += sorted({path for path, what in needed_paths(str(script))[0]
                     if what == "the sentinel package it imports" and not path.startswith(top + "/")})
    (dropin / "bind.conf").write_text("[Service]\n" + "".join(f"BindReadOnlyPaths={b}\n" for b in binds))
    r = install_bin(tmp_path / "node2", script)
    assert r.returncode == 0, r.stderr


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


def test_a_root_script_whose_interpreter_another_user_can_change_is_refused(attacker, shared_tmp, opt_dir):
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
    # the same script run by root's own Python, where the unit can see it: installed, and the agent
    # unit's launcher is that Python, isolated
    # (a venv of the system Python whose sentinel package is this checkout, as in the test above)
    venv_with_sentinel(opt_dir / "venv")
    python = opt_dir / "venv" / "bin" / "python3"
    script = _root_script(opt_dir / "bin", f"#!{python}\nfrom sentinel.cli import main\n")
    r = _install_bin(root, script)
    assert r.returncode == 0, r.stderr
    agent = (root / "etc/systemd/system/sentinel-agent@.service").read_text()
    assert f"ExecStart={python} -I -m sentinel launch --pidfile /run/sentinel/agent.pid" in agent
