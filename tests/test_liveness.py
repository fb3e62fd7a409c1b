"""Kubernetes sees a hung loop: /livez and /readyz fail once the last completed poll is older than
the limit (at most 3 polls by default), and sentinel_last_poll_timestamp_seconds stops (issue #23,
point 8)."""

from __future__ import annotations

import dataclasses
import re
import threading
import urllib.error
import urllib.request

from conftest import metric_value, wait_for
from sentinel.config import Config
from sentinel.daemon import Daemon
from sentinel.readings import SourceHealth
from sentinel.sources.nvml import NvmlSource
from sentinel.sources.simulated import SimulatedNvml


class StuckKernelSource:
    """A kernel-event source whose drain blocks while ``stuck`` is set (a perf buffer that never
    returns): the loop hangs there while the HTTP threads go on answering."""

    name = "stuck_source"

    def __init__(self) -> None:
        self.wake = lambda: None
        self.free = threading.Event()
        self.free.set()
        self.entered = threading.Event()

    def set_gpus(self, bus_to_gpu):
        return None

    def start(self) -> None:
        return None

    def drain(self):
        if not self.free.is_set():
            self.entered.set()
            self.free.wait(60)
        return [], []

    def health(self):
        return {self.name: SourceHealth(up=True)}

    def counters(self):
        return {}

    def close(self) -> None:
        self.free.set()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_liveness_fails_within_3_polls_of_a_hung_loop_and_recovers(tmp_path, sim_state):
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, daemon=dataclasses.replace(cfg.daemon, poll_interval_seconds=0.2, nvml_deadline_seconds=0.2,
                                        runtime_dir=str(tmp_path / "run"), state_dir=str(tmp_path / "state")),
        metrics=dataclasses.replace(cfg.metrics, port=0, listen_address="127.0.0.1"))
    stuck = StuckKernelSource()
    daemon = Daemon(cfg, NvmlSource(SimulatedNvml(str(sim_state)), deadline_seconds=0.2), event_sources=[stuck])
    daemon.start()
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    port = daemon.metrics_port
    try:
        assert get(port, "/livez")[0] == 200 and get(port, "/readyz")[0] == 200
        assert get(port, "/healthz")[0] == 200
        first = metric_value(get(port, "/metrics")[1], "sentinel_last_poll_timestamp_seconds")
        wait_for(lambda: metric_value(get(port, "/metrics")[1], "sentinel_last_poll_timestamp_seconds") > first,
                 timeout=20, what="the gauge to advance with the polls")

        stuck.free.clear()  # the loop now hangs in the source's drain
        assert stuck.entered.wait(20)
        status, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(get(port, "/livez")),
                                timeout=20, what="/livez to fail")
        assert "the loop is stuck" in body
        limit = float(re.search(r"limit of ([0-9.]+) s", body).group(1))
        assert limit <= 3 * cfg.daemon.poll_interval_seconds  # fails within 3 polls of the hang
        assert get(port, "/readyz")[0] == 503 and get(port, "/healthz")[0] == 503
        frozen = metric_value(get(port, "/metrics")[1], "sentinel_last_poll_timestamp_seconds")
        assert metric_value(get(port, "/metrics")[1], "sentinel_last_poll_timestamp_seconds") == frozen

        stuck.free.set()  # unstuck: the next completed poll makes it live again
        wait_for(lambda: get(port, "/livez")[0] == 200, timeout=20, what="/livez to recover")
        assert metric_value(get(port, "/metrics")[1], "sentinel_last_poll_timestamp_seconds") > frozen
    finally:
        stuck.free.set()
        daemon.stop()
        loop.join(timeout=5)
        daemon.close()


def test_the_daemonset_probes_the_liveness_endpoints():
    import yaml

    from conftest import REPO

    ds = yaml.safe_load((REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text())
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
