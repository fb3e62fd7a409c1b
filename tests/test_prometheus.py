"""A real Prometheus (Debian's package) scrapes the daemon; promtool checks the exposition."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from conftest import REPO, wait_for
from sentinel_tools.drill import free_port

pytestmark = pytest.mark.needs_prometheus


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (apt-get install prometheus)")
    return path


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
    prom_port = free_port()  # below the ephemeral range: no other suite's connection takes it first
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


def prometheus_api(port: int, path: str, **params: str):
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.load(resp)["data"]
    except OSError:
        return None


def test_source_down_alert_fires_only_when_the_node_is_blind(sim_state, start_daemon, tmp_path):
    """monitoring/alerts.yml, evaluated by a real Prometheus scraping a real daemon with eBPF off:
    the Xid signal read through /dev/kmsg and PCIe AER through sysfs are covered, so
    SentinelSourceDown stays quiet, and so it does with one GPU lost; NVML answering no read (every
    GPU lost) is blindness, and it fires."""
    prometheus = need("prometheus")
    d = start_daemon("--simulate", str(sim_state), "--no-ebpf")
    rules = tmp_path / "alerts.yml"  # the shipped rules, with every `for:` at 0s so a test can see them fire
    rules.write_text(re.sub(r"(?m)^(\s+for:) \S+$", r"\1 0s", (REPO / "monitoring" / "alerts.yml").read_text()))
    prom_port = free_port()  # below the ephemeral range: no other suite's connection takes it first
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {rules}\n"
        "scrape_configs:\n  - job_name: sentinel\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{d.port}']\n"
    )
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )

    def api(path: str, **params: str):
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
        return prometheus_api(prom_port, path, **params)

    def coverage() -> dict[str, tuple[str, str]] | None:
        data = api("query", query="sentinel_source_up")
        if not data or not data["result"]:
            return None
        return {r["metric"]["source"]: (r["metric"].get("via", ""), r["value"][1]) for r in data["result"]}

    def evaluated_after(t: float) -> bool:
        data = api("rules")
        if not data:
            return False
        rule = next(r for g in data["groups"] for r in g["rules"] if r["name"] == "SentinelSourceDown")
        return rule["health"] == "ok" and _rfc3339(rule["lastEvaluation"]) > t

    def source_down_alerts() -> list[dict]:
        data = api("alerts") or {"alerts": []}
        return [a for a in data["alerts"] if a["labels"]["alertname"] == "SentinelSourceDown"]

    try:
        seen = wait_for(lambda: (c := coverage()) and len(c) == 3 and c, timeout=60, interval=0.5,
                        what="Prometheus to scrape sentinel_source_up")
        assert seen == {"nvml": ("nvml", "1"), "xid": ("kmsg", "1"), "pcie_aer": ("sysfs", "1")}
        t_seen = time.time()
        for _ in range(3):  # three evaluations of the rule over these series, each after the last
            wait_for(lambda: evaluated_after(t_seen), timeout=30, interval=0.2, what="SentinelSourceDown evaluated")
            t_seen = time.time()
            assert source_down_alerts() == []

        from sentinel.sources import simulated

        simulated.inject(sim_state, 0, ["lost"])  # one GPU lost is a GPU reading, not a blind node
        wait_for(lambda: (api("query", query="sentinel_gpu_lost == 1") or {"result": []})["result"], timeout=30,
                 interval=0.5, what="GPU 0 lost in Prometheus")
        t_seen = time.time()
        wait_for(lambda: evaluated_after(t_seen), timeout=30, interval=0.2, what="SentinelSourceDown evaluated")
        assert source_down_alerts() == []
        for gpu in range(1, 4):  # every GPU lost: NVML answers no read, the node sees no GPU
            simulated.inject(sim_state, gpu, ["lost"])
        firing = wait_for(lambda: [a for a in source_down_alerts() if a["state"] == "firing"], timeout=60,
                          interval=0.5, what="SentinelSourceDown to fire for NVML")
        assert [(a["labels"]["source"], a["labels"]["via"]) for a in firing] == [("nvml", "none")]
        assert firing[0]["annotations"]["summary"] == f"Sentinel is blind to nvml on 127.0.0.1:{d.port}: no path reads it"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _rfc3339(text: str) -> float:
    """Prometheus's timestamps (nanosecond fractions, 'Z') as seconds since the epoch."""
    import datetime

    head, _, frac = text.rstrip("Z").partition(".")
    stamp = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.timezone.utc).timestamp()
    return stamp + (float("0." + frac.split("+")[0]) if frac else 0.0)
