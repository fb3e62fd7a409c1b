"""End to end, on this machine's kernel: a fallen-off-the-bus line with no Xid, written to
/dev/kmsg, migrates the GPU with that bus id, through eBPF and through the /dev/kmsg fallback;
an EDAC UE line snapshots. In CI a skip here is a failure."""

from __future__ import annotations

import json
import os

import pytest

from conftest import metric_value, require_ebpf, wait_for
from sentinel.sources import simulated

pytestmark = [pytest.mark.needs_root]


@pytest.fixture
def unique_state(tmp_path):
    """Four simulated GPUs; GPU 1 on a bus id no other test (or engineer) writes lines about."""
    state = simulated.healthy_state(4)
    bus = f"{0xc0 + os.getpid() % 0x3c:02x}"
    state["gpus"][1]["pci_bus_id"] = f"00000000:{bus.upper()}:00.0"
    path = tmp_path / "gpus.json"
    simulated.write_state(path, state)
    return path, f"0000:{bus}:00.0"


@pytest.mark.parametrize("path", ["ebpf", "kmsg_fallback"])
def test_fallen_off_the_bus_without_xid_migrates_that_gpu_and_edac_ue_snapshots(path, kmsg_writer, unique_state,
                                                                                 start_daemon):
    if path == "ebpf":
        require_ebpf("printk:console")
    state, bus = unique_state
    d = start_daemon("--simulate", str(state), *(["--no-ebpf"] if path == "kmsg_fallback" else []), ebpf=path == "ebpf")
    source = "ebpf_xid" if path == "ebpf" else "kmsg"
    assert metric_value(d.scrape(), "sentinel_source_up", source="xid", via="ebpf" if path == "ebpf" else "kmsg") == 1
    kmsg_writer("usb 1-1: sentinel e2e: not a signature")
    kmsg_writer(f"process 'sh' launched '/tmp/NVRM: GPU {bus}: GPU has fallen off the bus.' with NULL argv")  # quoted: no
    kmsg_writer(f"NVRM: GPU {bus}: GPU has fallen off the bus.")

    def migrated():
        t = d.scrape()
        return t if metric_value(t, "sentinel_policy_trips_total", rule="kernel_log", action="migrate") == 1 else None

    text = wait_for(migrated, timeout=15, what="the kernel_log migrate trip")
    assert metric_value(text, "sentinel_kernel_events_total", source=source, kind="gpu_fallen_off_bus") == 1
    assert metric_value(text, "sentinel_gpu_health", gpu="1") == 3
    assert metric_value(text, "sentinel_gpu_health", gpu="0") == 0
    trips = [json.loads(line) for line in d.log().splitlines() if '"policy_trip"' in line]
    assert [(t["rule"], t["action"], t["gpu"]) for t in trips] == [("kernel_log", "migrate", 1)]
    assert metric_value(text, "sentinel_gpu_xid_errors_total", gpu="1", xid="79") is None  # no Xid was made up

    kmsg_writer(f"EDAC MC0: 1 UE memory read error on sentinel-e2e-{os.getpid()} (channel:1 slot:0 page:0x1b4a1e)")

    def snapshotted():
        t = d.scrape()
        return t if metric_value(t, "sentinel_policy_trips_total", rule="kernel_log", action="snapshot") == 1 else None

    text = wait_for(snapshotted, timeout=15, what="the EDAC UE snapshot trip")
    assert metric_value(text, "sentinel_kernel_events_total", source=source, kind="host_memory_ue") == 1
    trips = [json.loads(line) for line in d.log().splitlines() if '"policy_trip"' in line]
    assert [(t["rule"], t["action"], t["gpu"]) for t in trips][-1] == ("kernel_log", "snapshot", -1)


@pytest.mark.parametrize("path", ["ebpf", "kmsg_fallback"])
def test_a_fallen_off_the_bus_message_printed_in_three_records_migrates_that_gpu(path, kmsg_writer, unique_state,
                                                                                 start_daemon):
    """The 570 driver's three-line message, as a driver or a log that splits it prints it: three
    records, each behind its own NVRM: tag. The one record assembly (sentinel/records.py) joins them
    on every path, as it does in `sentinel scan`."""
    if path == "ebpf":
        require_ebpf("printk:console")
    state, bus = unique_state
    d = start_daemon("--simulate", str(state), *(["--no-ebpf"] if path == "kmsg_fallback" else []), ebpf=path == "ebpf")
    kmsg_writer(f"NVRM: The NVIDIA GPU {bus}")
    kmsg_writer("NVRM: (PCI ID: 10de:2330) installed in this system has")
    kmsg_writer("NVRM: fallen off the bus and is not responding to commands.")

    def migrated():
        t = d.scrape()
        return t if metric_value(t, "sentinel_policy_trips_total", rule="kernel_log", action="migrate") == 1 else None

    text = wait_for(migrated, timeout=15, what="the kernel_log migrate trip of the split message")
    assert metric_value(text, "sentinel_gpu_health", gpu="1") == 3
    trips = [json.loads(line) for line in d.log().splitlines() if '"policy_trip"' in line]
    assert [(t["rule"], t["action"], t["gpu"]) for t in trips] == [("kernel_log", "migrate", 1)]


@pytest.mark.parametrize("path", ["ebpf", "kmsg_fallback"])
def test_a_corrected_aer_and_edac_burst_is_a_rate_never_a_drain(path, kmsg_writer, unique_state, start_daemon):
    """40 corrected AER reports on the GPU's own device and 15 EDAC CEs: the GPU is watched and one
    alert per kind carries the rate; nothing snapshots or migrates."""
    if path == "ebpf":
        require_ebpf("printk:console")
    state, bus = unique_state
    d = start_daemon("--simulate", str(state), *(["--no-ebpf"] if path == "kmsg_fallback" else []), ebpf=path == "ebpf")
    for _ in range(20):
        kmsg_writer(f"nvidia {bus}: AER: Corrected error received: {bus}")
        kmsg_writer(f"nvidia {bus}: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)")
        kmsg_writer(f"nvidia {bus}:   device [10de:2330] error status/mask=00000001/0000e000")
    for i in range(15):
        kmsg_writer(f"EDAC MC0: 1 CE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#{i % 2} (sentinel-e2e-{os.getpid()})")
    source = "ebpf_xid" if path == "ebpf" else "kmsg"

    def counted():
        t = d.scrape()
        done = (metric_value(t, "sentinel_kernel_events_total", source=source, kind="host_memory_ce") == 15
                and metric_value(t, "sentinel_kernel_events_total", source=source, kind="pcie_aer_corrected") == 40)
        return t if done and metric_value(t, "sentinel_policy_trips_total", rule="corrected_rate", action="alert") == 2 \
            else None

    text = wait_for(counted, timeout=20, what="every corrected error counted and the two rate alerts")
    assert metric_value(text, "sentinel_gpu_health", gpu="1") == 1  # WATCH: the predictor sees the rate
    trips = [json.loads(line) for line in d.log().splitlines() if '"policy_trip"' in line]
    assert {(t["rule"], t["action"]) for t in trips} == {("corrected_rate", "alert")}
    assert sorted(t["gpu"] for t in trips) == [-1, 1]
    aer = next(t for t in trips if t["gpu"] == 1)
    assert aer["values"]["rate_per_hour"] >= 10
