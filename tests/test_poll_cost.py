"""What the daemon's own loop costs (issue #45): one poll's CPU split by part, an Xid storm, and
the changes that keep both low without changing a decision.

CPU time throughout (``time.process_time`` / ``time.thread_time``), never wall time; the bounds are
the issue's targets with room for a loaded 2-core host (bench/poll_overhead.py prints the figures).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, wait_for
from sentinel import config
from sentinel.policy import APP_XID_WINDOW_SECONDS, Policy, PolicyState, dedupe_xids
from sentinel.readings import GpuReading, NodeReadings, XidEvent
from sentinel.sources import simulated

sys.path.insert(0, str(REPO / "bench"))
import _poll_profile  # noqa: E402


# -- the profile -------------------------------------------------------------------------------------
def test_one_poll_of_8_gpus_costs_the_daemon_under_2_ms_of_cpu_and_the_parts_add_up():
    r = _poll_profile.profile(8, polls=60, call_cost=simulated.NVML_CALL_SECONDS, batches=6)
    parts = sum(r[p] for p in _poll_profile.PARTS)
    assert parts == pytest.approx(r["total"], rel=1e-6)  # every CPU-second of the process is in one part
    assert r["backend"] >= 8 * 7 * simulated.NVML_CALL_SECONDS * 0.8  # 7 calls per GPU, each a real call's cost
    # the target is 2 ms (0.2 % of a core at 1 Hz), measured 1.5 ms on the project's 2-core VM, where
    # it was 11 ms before issue #45; CPU time inflates on a host busy with other work (2.5x seen
    # under a parallel suite), so the bound catches a regression, not the last tenth of a ms
    assert r["daemon"] < 6.0, r


def test_the_simulated_backend_spends_a_real_calls_cpu_without_holding_the_gil(tmp_path):
    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(1))
    nvml = simulated.SimulatedNvml(state, call_cost_seconds=2e-3)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    ticks = []
    stop = threading.Event()

    def other_thread():  # runs Python while the calls spend: it would not if they held the GIL
        while not stop.is_set():
            ticks.append(time.thread_time())

    t = threading.Thread(target=other_thread)
    t.start()
    cpu = time.thread_time()
    for _ in range(10):
        nvml.nvmlDeviceGetUUID(h)
    spent = time.thread_time() - cpu
    stop.set()
    t.join()
    assert spent >= 10 * 2e-3 * 0.8
    assert len(ticks) > 100
    free = simulated.SimulatedNvml(state, call_cost_seconds=0)
    free.nvmlInit()
    cpu = time.thread_time()
    for _ in range(10):
        free.nvmlDeviceGetUUID(h)
    assert time.thread_time() - cpu < 10 * 2e-3 / 4


# -- an Xid storm --------------------------------------------------------------------------------------
def test_an_xid_storm_is_counted_whole_and_costs_the_daemon_a_few_percent_of_a_core():
    s = _poll_profile.storm(8, rate=1000, seconds=3, call_cost=simulated.NVML_CALL_SECONDS)
    assert s["sent"] == 3000 and s["lost"] == 0
    assert s["counted"] == s["sent"]  # every Xid reached the policy's counts: nothing dropped
    # the target is 5 % of a core, measured 4.3 % on the 2-core VM (17 % before issue #45); room
    # for a host busy with other work, as above
    assert s["storm_daemon_percent"] < 15.0, s


def _decide_every(policy: Policy, batches: list[tuple[float, list[XidEvent]]]) -> tuple[list[bool], PolicyState]:
    """Whether app_xid_rate tripped at each decision, feeding ``batches`` (time, events) in order."""
    state = PolicyState()
    g = GpuReading(index=0, uuid="u", pci_bus_id="0000:18:00.0")
    out = []
    for now, events in batches:
        readings = NodeReadings(time=now, driver_version="x", gpus=(g,), xid_events=tuple(events), sources={},
                                nvml_errors={}, kernel_events=(), events_only=True)
        state, trips = policy.decide(state, readings, now)
        out.append(any(t.rule == "app_xid_rate" for t in trips))
    return out, state


def test_the_application_xid_rate_decides_as_an_exact_hourly_count_would_with_bounded_memory():
    cfg = dataclasses.replace(config.parse("").policy, app_xid_max_per_hour=5, cooldown_seconds=0.0)
    policy = Policy(cfg)
    rng = random.Random(4)
    now, batches = 0.0, []
    for _ in range(400):  # bursts and lulls over a few hours: the count crosses the limit both ways
        now += rng.choice([1.0, 30.0, 400.0, 1500.0])
        batches.append((now, [XidEvent(gpu=0, xid=13, source="kmsg") for _ in range(rng.choice([0, 1, 1, 2, 7]))]))
    tripped, state = _decide_every(policy, batches)
    # the reference: every application Xid's time kept, counted over the last hour
    times: list[float] = []
    expected = []
    for now, events in batches:
        hit = False
        for _ in events:
            times = [t for t in times if now - t < APP_XID_WINDOW_SECONDS] + [now]
            hit = hit or len(times) > cfg.app_xid_max_per_hour
        expected.append(hit)
    assert tripped == expected and any(expected) and not all(expected)
    assert len(state.gpus[0].app_xids) <= cfg.app_xid_max_per_hour + 1  # runs, not one entry per Xid


def test_xid_dedup_keeps_one_entry_per_gpu_xid_and_source_in_a_storm():
    recent: dict = {}
    accepted = 0
    for i in range(200):  # 10,000 Xids from the kernel log, the same ones from NVML
        now = i * 0.05
        batch = [XidEvent(gpu=0, xid=13, source="kmsg") for _ in range(50)]
        recent, kept = dedupe_xids(recent, batch, now)
        accepted += len(kept)
        recent, dup = dedupe_xids(recent, [XidEvent(gpu=0, xid=13, source="nvml")], now)
        assert dup == []  # the kernel log reported it within 5 s: NVML's copy is dropped
    assert accepted == 10_000 and {k: set(v) for k, v in recent.items()} == {(0, 13): {"kmsg"}}


# -- the loop -------------------------------------------------------------------------------------------
def _started(tmp_path, poll_seconds: float):
    from sentinel.builder import build_daemon
    from sentinel.sources.kernel import KernelSource

    class Pushed(KernelSource):  # kernel events the test pushes, as a reader thread would
        name = "pushed"

        def start(self) -> None:
            self.up = {"pushed": True}

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    cfg = config.parse(f'[daemon]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                       f'poll_interval_seconds = {poll_seconds}\n[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
                       f'[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    source = Pushed()
    daemon = build_daemon(cfg, simulate=str(state), event_sources=[source])
    daemon.start()
    calls = []
    events = daemon.poll_events
    daemon.poll_events = lambda: (calls.append(time.monotonic()), events())[1]
    loop = threading.Thread(target=daemon.run, daemon=True)
    loop.start()
    return daemon, source, calls, loop


def test_kernel_events_between_polls_are_decided_at_once_and_a_burst_together(tmp_path):
    daemon, source, calls, loop = _started(tmp_path, poll_seconds=30.0)  # no poll in the way
    try:
        time.sleep(0.3)
        pushed = time.monotonic()
        source.push(XidEvent(gpu=0, xid=79, source="kmsg"))
        wait_for(lambda: calls, timeout=5, what="the event-driven iteration")
        assert calls[0] - pushed < 0.1  # the first event after a quiet spell waits for nothing
        wait_for(lambda: daemon.policy_state.xid_counts.get(0, {}).get(79) == 1, what="Xid 79 counted")
        start = time.monotonic()
        for _ in range(200):  # a burst of 200 over about 1 s
            source.push(XidEvent(gpu=1, xid=13, source="kmsg"))
            time.sleep(0.005)
        wait_for(lambda: daemon.policy_state.xid_counts.get(1, {}).get(13) == 200, what="every Xid of the burst")
        during = [t for t in calls if t >= start]
        span = time.monotonic() - start
        assert len(during) <= span / 0.2 + 2  # decided on together: at most one iteration per 0.2 s
    finally:
        daemon.stop()
        loop.join(timeout=10)
        daemon.close()


def test_the_exposition_is_rendered_by_the_first_scrape_after_a_poll_once(tmp_path):
    from sentinel.builder import build_daemon

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(2))
    cfg = config.parse(f'[daemon]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                       f'[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n[ebpf]\nenabled = false\nkmsg_fallback = false\n')
    daemon = build_daemon(cfg, simulate=str(state), event_sources=[])
    renders = []
    daemon.start()
    try:
        refresh = daemon.httpd.refresh
        daemon.httpd.refresh = lambda: (renders.append(1), refresh())[1]
        for _ in range(5):
            daemon.poll_once()
        assert renders == []  # polls publish views; none is rendered until asked for
        simulated.inject(state, 0, ["temp=91"])

        def hot():  # a poll that read 91 on GPU 0 (a loaded machine can take a poll or two to see the file)
            gpus = daemon.poll_once().gpus
            return bool(gpus) and gpus[0].values.get("temperature_celsius") == 91

        wait_for(hot, 60, interval=0.05, what="a poll that reads GPU 0 at 91 C")
        assert renders == []  # still none: only a scrape renders
        url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
        bodies = []
        for _ in range(3):
            with urllib.request.urlopen(url, timeout=10) as r:
                bodies.append(r.read().decode())
        assert len(renders) == 1 and bodies[0] == bodies[1] == bodies[2]
        assert 'sentinel_gpu_temperature_celsius{' in bodies[0] and " 91.0" in bodies[0]
    finally:
        daemon.close()
