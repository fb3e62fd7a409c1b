"""Sentinel as a user installs it: the built wheel in a fresh venv, outside this checkout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, make_venv, metric_value, require_ebpf, wait_for

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH: what runs must come from the venv, not from this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def test_the_wheel_ships_the_bpf_programs_the_units_and_complete_metadata(built_wheel):
    with zipfile.ZipFile(built_wheel) as whl:
        names = set(whl.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = whl.read(meta_name).decode()
        (eps_name,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = whl.read(eps_name).decode()
    for path in sorted((REPO / "ebpf").iterdir()):
        assert f"sentinel/ebpf/{path.name}" in names, path.name
    for path in sorted((REPO / "systemd").iterdir()):
        assert f"sentinel/units/{path.name}" in names, path.name
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    assert re.search(r"^Classifier: Operating System :: POSIX :: Linux$", meta, re.M)
    assert re.search(r"^Classifier: Topic :: System :: Monitoring$", meta, re.M)
    assert re.search(r"^Project-URL: Source, https://", meta, re.M)
    assert re.search(r"^Requires-Dist: prometheus-client>=\d", meta, re.M)
    assert "sentinel = sentinel.cli:main" in entry_points
    assert "[torchrun.handlers]" in entry_points and "sentinel = trainer.slot_rendezvous:torchrun_entry_point" in entry_points


@pytest.fixture(scope="module")
def wheel_venv(built_wheel):
    """The wheel in a venv under /opt, root's and visible to the units (`sentinel install` refuses an
    installation under /tmp, which the unit's PrivateTmp= hides)."""
    import shutil
    import tempfile

    os.makedirs("/opt", exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="sentinel-test-", dir="/opt"))
    os.chmod(top, 0o755)
    try:
        yield make_venv(top / "v", str(built_wheel))
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_installed_wheel_finds_its_programs_in_site_packages_and_loads_a_probe(wheel_venv, tmp_path):
    code = ("import sentinel, json; from sentinel.sources.ebpf import ebpf_dir; "
            "print(json.dumps([sentinel.__file__, str(ebpf_dir()), sorted(p.name for p in ebpf_dir().iterdir())]))")
    r = subprocess.run([str(wheel_venv), "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    module, programs, files = json.loads(r.stdout)
    venv = wheel_venv.parents[1]
    assert module.startswith(str(venv)) and programs.startswith(str(venv)) and "site-packages" in programs
    assert not programs.startswith(str(REPO))
    assert "xid.bpf.c" in files and "events.h" in files
    require_ebpf("printk:console")
    # the Xid probe compiled by bcc from the installed package data, on the eBPF path (no fallback)
    code = ("from sentinel.sources.xid import XidSource; s = XidSource(kmsg_fallback=False); s.start(); "
            "h = s.health()['xid']; print(s.path, h.via, h.up); s.close()")
    r = subprocess.run([str(wheel_venv), "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ebpf:printk:console", "ebpf", "True"], r.stdout + r.stderr


def test_installed_wheel_runs_the_daemon_on_simulated_gpus(wheel_venv, tmp_path):
    sentinel = wheel_venv.parent / "sentinel"
    state = tmp_path / "gpus.json"
    r = subprocess.run([str(sentinel), "simulate", "init", str(state), "--gpus", "2"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env=clean_env())
    assert r.returncode == 0, r.stderr
    run, log = tmp_path / "run", tmp_path / "daemon.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(sentinel), "run", "--simulate", str(state), "--runtime-dir", str(run),
                                 "--state-dir", str(tmp_path / "state"), "--port", "0", "--listen-address", "127.0.0.1",
                                 "--no-ebpf"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=clean_env())
    try:
        wait_for(lambda: proc.poll() is None and (run / "status.json").exists() or proc.poll() is not None,
                 timeout=60, what="status.json")
        assert proc.poll() is None, log.read_text()
        status = json.loads((run / "status.json").read_text())
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{status['metrics_port']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert metric_value(text, "sentinel_source_up", source="nvml", via="nvml") == 1.0
        r = subprocess.run([str(sentinel), "status", "--runtime-dir", str(run)], capture_output=True, text=True,
                           timeout=60, env=clean_env())
        assert r.returncode == 0 and "healthy" in r.stdout, r.stdout + r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert proc.returncode == 0, log.read_text()


def prometheus_floor() -> str:
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("prometheus-client")]
    return spec.split(">=", 1)[1]


@pytest.mark.slow
def test_the_metric_tests_pass_with_the_lowest_prometheus_client_allowed(tmp_path):
    """pyproject's floor is a version the exporter really works with (0.17-0.22 do not)."""
    floor = prometheus_floor()
    # the test dependencies from this interpreter; prometheus-client itself at the floor, in the venv
    py = make_venv(tmp_path / "floor", f"prometheus-client=={floor}", python=sys.executable, system_site_packages=True)
    r = subprocess.run([str(py), "-c", "import prometheus_client as p, importlib.metadata as m; "
                        "print(m.version('prometheus-client'), p.__file__)"], capture_output=True, text=True, env=clean_env())
    version, where = r.stdout.split()
    assert version == floor and where.startswith(str(tmp_path)), r.stdout + r.stderr
    r = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_exporter.py",
                        "tests/test_fleet_metrics.py", "tests/test_fields.py"],
                       capture_output=True, text=True, timeout=900, cwd=REPO, env=clean_env(PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(r"\d+ passed", r.stdout)


def test_installed_wheel_installs_the_node_files_pointing_at_itself(wheel_venv, tmp_path):
    sentinel = wheel_venv.parent / "sentinel"
    r = subprocess.run([str(sentinel), "install", "--root", str(tmp_path / "node"), "--no-reload"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    unit = (tmp_path / "node/etc/systemd/system/sentinel.service").read_text()
    assert f"ExecStart={sentinel} run --config /etc/sentinel/sentinel.toml" in unit
    assert (tmp_path / "node/etc/sentinel/sentinel.toml").read_text() == (REPO / "systemd/sentinel.toml").read_text()


def test_installed_wheel_scans_a_kernel_log_with_its_shipped_signature_catalog(wheel_venv, tmp_path):
    sentinel = wheel_venv.parent / "sentinel"
    state = tmp_path / "gpus.json"
    r = subprocess.run([str(sentinel), "simulate", "init", str(state), "--gpus", "2"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env=clean_env())
    assert r.returncode == 0, r.stderr
    kern = tmp_path / "kern.log"
    kern.write_text("[ 10.0] usb 1-1: new device\n[ 11.0] NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.\n")
    r = subprocess.run([str(sentinel), "scan", "--simulate", str(state), "--kmsg", str(kern), "--json"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path, env=clean_env())
    assert r.returncode == 2, r.stdout + r.stderr  # critical
    findings = json.loads(r.stdout)["findings"]
    assert [(f["kind"], f["gpu"], f["action"]) for f in findings] == [("gpu_fallen_off_bus", 1, "migrate")]
