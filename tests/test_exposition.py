"""sentinel/exposition.py renders the text format byte for byte as prometheus_client's
generate_latest does (issue 45: generate_latest was ~14 ms a scrape of a 64-GPU node)."""

from __future__ import annotations

import math

from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, InfoMetricFamily, Metric, StateSetMetricFamily)
from prometheus_client.exposition import generate_latest

from sentinel.exposition import Snapshot, TextRenderer
from sentinel.sources import simulated


def _both(families: list[Metric]) -> tuple[bytes, bytes]:
    return TextRenderer().render(families), generate_latest(Snapshot(families))


def test_every_family_type_value_and_escape_renders_as_prometheus_client_does():
    g = GaugeMetricFamily("sentinel_odd_gauge", 'help with \\ a backslash,\n a newline and "quotes"', labels=["b", "a"])
    for i, v in enumerate((0.0, -0.0, 1.0, 1e7, 123456789.0, 1.5e-9, -3.25, math.inf, -math.inf, math.nan, 10**20, 7)):
        g.add_metric([f"v{i}", 'back\\slash "quoted"\nnew line ünïcode'], v)
    g.add_metric(["stamped", ""], 2.0, timestamp=1700000000.123)
    c = CounterMetricFamily("sentinel_things", "Things", labels=["kind"], created=1700000000.0)
    c.add_metric(["x"], 3.0, created=1700000001.5)
    info = InfoMetricFamily("sentinel_build", "Build", value={"version": "1.2", "commit": "abc"})
    states = StateSetMetricFamily("sentinel_state", "State", value={"up": True, "down": False})
    hist = HistogramMetricFamily("sentinel_latency_seconds", "Latency", buckets=[("0.1", 1), ("+Inf", 3)], sum_value=0.7)
    ghist = GaugeHistogramMetricFamily("sentinel_queue", "Queue", buckets=[("1", 2), ("+Inf", 5)], gsum_value=9)
    odd_names = GaugeMetricFamily("sentinel.dotted-name", "Not a legacy name", labels=["label.with.dots", "ok"])
    odd_names.add_metric(["1", "2"], 1.0)
    unknown = Metric("sentinel_untyped", "Untyped", "unknown")
    unknown.add_sample("sentinel_untyped", {}, 4.0)
    empty = GaugeMetricFamily("sentinel_empty", "")
    ours, theirs = _both([g, c, info, states, hist, ghist, odd_names, unknown, empty])
    assert ours == theirs


def test_a_simulated_nodes_whole_exposition_renders_as_prometheus_client_does(tmp_path):
    """The daemon's own families (64 GPUs, faults on some, both export details), side by side."""
    from sentinel import config
    from sentinel.builder import build_daemon

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(64))
    simulated.inject(state, 3, ["nvlink-crc=+9@5", "ecc-sbe=+2", "xid=79", "temp=91"])
    simulated.inject(state, 40, ["remap-pending", "set=recovery_action:2"])
    for detail in ("fleet", "full"):
        run = tmp_path / detail
        cfg = config.parse(f'[daemon]\nruntime_dir = "{run / "run"}"\nstate_dir = "{run / "state"}"\n'
                           f'[metrics]\nlisten_address = "127.0.0.1"\nport = 0\ndetail = "{detail}"\n'
                           f'[ebpf]\nenabled = false\nkmsg_fallback = false\n')
        daemon = build_daemon(cfg, nvml_backend=simulated.SimulatedNvml(state, call_cost_seconds=0), event_sources=[])
        try:
            daemon.start()
            for _ in range(3):
                daemon.poll_once()
            families = list(daemon.httpd.registry.collect())
            ours, theirs = _both(families)
            assert ours == theirs and len(ours.splitlines()) > 64 * 10
            assert daemon.httpd.exposition().startswith(b"# HELP")
        finally:
            daemon.close()
