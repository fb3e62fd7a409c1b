"""eBPF probes for real: root, bcc, this machine's kernel. In CI a skip here is a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import metric_value, register_agent, require_ebpf, wait_for

pytestmark = [pytest.mark.needs_root, pytest.mark.needs_ebpf]


@pytest.fixture
def kmsg(kmsg_writer):
    """Write lines to the kernel log (conftest's kmsg_writer), once eBPF is known to be usable."""
    require_ebpf()
    return kmsg_writer


XID79_GPU1 = "NVRM: Xid (PCI:0000:2a:00): 79, pid=4242, name=python3, GPU has fallen off the bus."


@pytest.mark.parametrize("path", ["ebpf", "kmsg_fallback"])
def test_kernel_xid_reaches_metrics_and_trips_migrate_for_that_gpu(path, kmsg, sim_state, start_daemon):
    args = ["--simulate", str(sim_state)] + (["--no-ebpf"] if path == "kmsg_fallback" else [])
    d = start_daemon(*args, ebpf=path == "ebpf")
    text = d.scrape()
    # one series for the signal: the kmsg fallback covers it, so it is up (not an eBPF path down)
    assert metric_value(text, "sentinel_source_up", source="xid", via="ebpf" if path == "ebpf" else "kmsg") == 1
    kmsg("usb 1-1: this line is not an Xid")
    kmsg(XID79_GPU1)
    kmsg(XID79_GPU1.replace("pid=4242", "pid=4243"))

    def counted():
        t = d.scrape()
        return t if metric_value(t, "sentinel_gpu_xid_errors_total", gpu="1", xid="79") == 2 else None

    text = wait_for(counted, timeout=15, what="Xid 79 counted on GPU 1")
    assert metric_value(text, "sentinel_gpu_xid_errors_total", gpu="0", xid="79") is None
    assert metric_value(text, "sentinel_policy_trips_total", rule="xid", action="migrate") == 1  # cooldown: once
    assert metric_value(text, "sentinel_gpu_health", gpu="1") == 3
    assert metric_value(text, "sentinel_gpu_health", gpu="0") == 0
    assert '"rule":"xid","action":"migrate","gpu":1' in d.log()


def test_malformed_xid_line_is_counted_and_ignored(kmsg, sim_state, start_daemon):
    d = start_daemon("--simulate", str(sim_state), ebpf=True)
    kmsg("NVRM: Xid (PCI:0000:2a:00): garbage here")
    source = "ebpf_xid"
    wait_for(lambda: metric_value(d.scrape(), "sentinel_kmsg_malformed_lines_total", source=source) == 1,
             timeout=15, what="malformed line counted")
    assert metric_value(d.scrape(), "sentinel_policy_trips_total", rule="xid", action="migrate") is None


def test_sigbus_to_a_registered_rank_is_seen(tmp_path):
    require_ebpf()
    from sentinel.sources.rank_signals import RankSignalSource

    ranks = tmp_path / "ranks"
    ranks.mkdir()
    dummy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (ranks / f"{dummy.pid}.sock").write_text("")  # registered the way a rank registers: a socket named by pid
    src = RankSignalSource(ranks)
    src.start()
    try:
        assert src.up == {"ebpf_rank_signals": True} and dummy.pid in src.watched
        os.kill(bystander.pid, signal.SIGBUS)  # not a rank: filtered in the kernel
        os.kill(dummy.pid, signal.SIGBUS)
        events = wait_for(lambda: src.drain()[1] or None, timeout=10, what="SIGBUS event")
        assert len(events) == 1
        e = events[0]
        assert e.kind == "rank_signal" and e.detail["signal"] == "SIGBUS" and e.detail["pid"] == dummy.pid
        assert e.detail["code"] == 0  # SI_USER: sent with kill(2)
        assert e.detail["sender_pid"] == os.getpid()
        dummy.wait(timeout=10)
        bystander.wait(timeout=10)
        assert dummy.returncode == -signal.SIGBUS
    finally:
        src.close()
        for p in (dummy, bystander):
            if p.poll() is None:
                p.kill()


def test_kill_bus_to_a_rank_is_counted_and_alerted_but_never_migrates(kmsg, sim_state, start_daemon, tmp_path):
    """A SIGBUS anyone can send (kill -BUS: si_code SI_USER) is no memory failure: only
    BUS_MCEERR_AR/AO, which the kernel alone sends, migrate (tests/test_kernel_trust.py)."""
    runtime = tmp_path / "run"
    register_agent(runtime)  # this test process is the agent; its child is a verified rank
    d = start_daemon("--simulate", str(sim_state), runtime_dir=runtime, ebpf=True)
    rank = subprocess.Popen([sys.executable, "-c",
                             "import sys, time; sys.path.insert(0, sys.argv[1]);"
                             "from sentinel.channel import RankEndpoint; from pathlib import Path;"
                             "e = RankEndpoint.open(Path(sys.argv[2])); print(type(e).__name__, flush=True); time.sleep(60)",
                             str(Path(__file__).resolve().parents[1]), str(d.runtime_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "RankEndpoint"
        time.sleep(1.5)  # the daemon syncs its watched pids at its next poll (1 s)
        os.kill(rank.pid, signal.SIGBUS)
        wait_for(lambda: metric_value(d.scrape(), "sentinel_policy_trips_total", rule="rank_signal", action="alert") == 1,
                 timeout=15, what="rank_signal alert trip")
        text = d.scrape()
        assert metric_value(text, "sentinel_kernel_events_total", source="ebpf_rank_signals", kind="SIGBUS_not_memory") == 1
        assert metric_value(text, "sentinel_policy_trips_total", rule="rank_signal", action="migrate") is None
        assert '"action":"migrate"' not in d.log()
    finally:
        if rank.poll() is None:
            rank.kill()
        rank.wait(timeout=10)


def test_burst_of_10000_lines_loses_nothing_or_counts_exactly(kmsg):
    from sentinel.sources.xid import XidSource

    src = XidSource(use_ebpf=True, kmsg_fallback=False)
    src.set_gpus({"0000:18:00.0": 0, "0000:2a:00.0": 1})
    src.start()
    try:
        assert src.path == "ebpf:printk:console"
        xids = 0
        for i in range(10_000):
            if i % 10 == 0:
                kmsg(f"NVRM: Xid (PCI:0000:{'18' if i % 20 else '2a'}:00): 13, pid={i}, name=burst, Graphics Exception {i}")
                xids += 1
            else:
                kmsg(f"burst filler line {i}: eth0 link up, nothing to see")
        got: list = []

        def settled():
            got.extend(src.drain()[0])
            return len(got) + src.probe.lost() >= xids

        wait_for(settled, timeout=60, what="all burst events delivered or counted lost")
        time.sleep(0.5)
        got.extend(src.drain()[0])
        lost = src.probe.lost()
        assert len(got) + lost == xids == 1000
        assert len({e.pid for e in got}) == len(got)  # no duplicates
        assert {e.gpu for e in got} <= {0, 1}
        counters = src.counters()
        assert counters[("sentinel_ebpf_events_lost", (("probe", "xid"),))] == lost
        print(f"burst: {len(got)} delivered, {lost} lost of {xids}")
    finally:
        src.close()
