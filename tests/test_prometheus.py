"""A real Prometheus (Debian's package) scrapes the daemon; promtool checks the exposition."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest

from conftest import wait_for

pytestmark = pytest.mark.needs_prometheus


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_promtool_check_metrics_on_a_scrape(sim_state, start_daemon):
    promtool = need("promtool")
    d = start_daemon("--simulate", str(sim_state))
    from sentinel.sources import simulated

    simulated.inject(sim_state, 0, ["xid=79", "ecc-sbe=+2"])
    wait_for(lambda: "xid=\"79\"" in d.scrape(), what="xid in scrape")
    r = subprocess.run([promtool, "check", "metrics"], input=d.scrape(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr  # no lint warnings either


def test_real_prometheus_scrapes_injected_value(sim_state, start_daemon, tmp_path):
    prometheus = need("prometheus")
    d = start_daemon("--simulate", str(sim_state))
    from sentinel.sources import simulated

    simulated.inject(sim_state, 1, ["ecc-dbe=+3"])
    prom_port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sentinel\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{d.port}']\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        query = 'sentinel_gpu_ecc_errors_total{gpu="1",type="uncorrected",scope="volatile"}'

        def result():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    data = json.load(resp)
            except OSError:
                return None
            res = data["data"]["result"]
            return res if res and res[0]["value"][1] == "3" else None

        res = wait_for(result, timeout=60, interval=0.5, what="Prometheus to return the injected value")
        assert res[0]["metric"]["uuid"] == "GPU-5e0a1c2d-0000-4000-8000-000000000001"
        assert res[0]["metric"]["job"] == "sentinel"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
