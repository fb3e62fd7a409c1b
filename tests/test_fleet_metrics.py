"""What a scrape costs a fleet: the default export fits its budget (series per GPU, bytes per
node), per-link and "all is well" series only where they say something, and one coverage series
per signal that is 0 only where the node is blind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest

from conftest import metric_value
from sentinel import config
from sentinel.metrics import View, build_registry
from sentinel.readings import NVLINK_KINDS, GpuReading, NodeReadings, SourceHealth
from sentinel.sources import simulated
from sentinel.sources.pcie_aer import PcieAerSource

SERIES_PER_GPU = 40
# 30 KiB until issue #23/#24 added the liveness gauge (sentinel_last_poll_timestamp_seconds) and the
# migration-deadline counter (two zero series, so that its alert sees the first increase): 30,924 B
# after the long HELP texts were shortened. The per-GPU series are what a fleet pays for.
BYTES_PER_8_GPUS = 31 * 1024


def samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def names(text: str) -> set[str]:
    return {re.match(r"[a-z_]+", line).group(0) for line in samples(text)}


def eight_gpu_node(tmp_path: Path, start_daemon, *config_lines: str):
    state = tmp_path / "gpus8.json"
    simulated.write_state(state, simulated.healthy_state(8))
    args = ["--simulate", str(state)]
    if config_lines:
        cfg = tmp_path / "metrics.toml"
        cfg.write_text("[metrics]\n" + "\n".join(config_lines) + "\n")
        args += ["--config", str(cfg)]
    return start_daemon(*args)


def test_default_scrape_of_8_gpus_with_18_nvlinks_fits_the_fleet_budget(tmp_path, start_daemon):
    assert simulated.NVLINK_LINKS == 18  # an H100's links: the counters that used to be 576 series
    text = eight_gpu_node(tmp_path, start_daemon).scrape()
    series = samples(text)
    assert len(series) <= SERIES_PER_GPU * 8, f"{len(series)} series for 8 GPUs ({len(series) / 8:.1f} per GPU)"
    assert len(text.encode()) <= BYTES_PER_8_GPUS, f"{len(text.encode())} bytes for 8 GPUs"
    # what the budget left out by default ...
    assert not names(text) & {"sentinel_gpu_nvlink_link_errors_total", "sentinel_gpu_field_supported",
                              "sentinel_policy_rule_active"}
    # ... and what it keeps: every GPU's NVLink counters, summed over its 18 links, by kind
    for gpu in range(8):
        for kind in NVLINK_KINDS:
            assert metric_value(text, "sentinel_gpu_nvlink_errors_total", gpu=str(gpu), kind=kind) == 0


def test_detail_full_exports_every_link_and_every_state(tmp_path, start_daemon):
    text = eight_gpu_node(tmp_path, start_daemon, 'detail = "full"').scrape()
    per_link = [s for s in samples(text) if s.startswith("sentinel_gpu_nvlink_link_errors_total{")]
    assert len(per_link) == 8 * (18 * len(NVLINK_KINDS) - 6)  # the simulated H100's links 12-17 have no data-CRC counter
    assert metric_value(text, "sentinel_gpu_field_supported", gpu="7", field="temperature_celsius") == 1
    assert metric_value(text, "sentinel_policy_rule_active", gpu="7", rule="thermal") == 1
    assert len(samples(text)) > SERIES_PER_GPU * 8  # the shape a fleet should not scrape


def test_detail_is_validated():
    assert config.parse("").metrics.detail == "fleet"
    assert config.parse('[metrics]\ndetail = "full"\n').metrics.detail == "full"
    with pytest.raises(config.ConfigError, match=r"^metrics\.detail: must be one of fleet, full"):
        config.parse('[metrics]\ndetail = "everything"\n')


def render(gpus: list[GpuReading], *, detail: str = "fleet", rule_active=None, sources=None) -> str:
    readings = NodeReadings(time=0.0, driver_version="550", gpus=tuple(gpus), sources=sources or {})
    view = View(readings, rule_active=rule_active or {}, detail=detail)
    return generate_latest(build_registry(lambda: view)).decode()


def nvlink(errors: dict[tuple[int, str], int]) -> dict[tuple[int, str], int]:
    counters = {(link, kind): 0 for link in range(18) for kind in NVLINK_KINDS}
    counters.update(errors)
    return counters


def test_nvlink_is_summed_per_gpu_and_only_links_with_errors_are_exported_per_link():
    g = GpuReading(0, "GPU-a", "0000:18:00.0", nvlink=nvlink({(3, "crc_flit"): 5, (11, "crc_flit"): 2, (11, "replay"): 1}))
    text = render([g])
    assert metric_value(text, "sentinel_gpu_nvlink_errors_total", gpu="0", uuid="GPU-a", kind="crc_flit") == 7
    assert metric_value(text, "sentinel_gpu_nvlink_errors_total", gpu="0", kind="replay") == 1
    assert metric_value(text, "sentinel_gpu_nvlink_errors_total", gpu="0", kind="recovery") == 0
    per_link = [s for s in samples(text) if s.startswith("sentinel_gpu_nvlink_link_errors_total{")]
    assert len(per_link) == 2 * len(NVLINK_KINDS)  # links 3 and 11, every kind of each
    assert metric_value(text, "sentinel_gpu_nvlink_link_errors_total", gpu="0", link="3", kind="crc_flit") == 5
    assert metric_value(text, "sentinel_gpu_nvlink_link_errors_total", gpu="0", link="3", kind="replay") == 0
    assert metric_value(text, "sentinel_gpu_nvlink_link_errors_total", gpu="0", link="4", kind="crc_flit") is None
    # the sum never double-counts: per-link series are a family of their own
    assert "sentinel_gpu_nvlink_errors_total{" not in "".join(s for s in samples(text) if 'link="' in s)


def test_supported_and_active_are_exported_only_where_they_are_0():
    g = GpuReading(0, "GPU-a", "0000:18:00.0", values={"temperature_celsius": 40.0},
                   unsupported=frozenset({"pcie_replay"}))
    active = {("thermal", 0): True, ("pcie_replay_rate", 0): False}
    text = render([g], rule_active=active)
    assert metric_value(text, "sentinel_gpu_field_supported", gpu="0", field="pcie_replay") == 0
    assert metric_value(text, "sentinel_gpu_field_supported", gpu="0", field="temperature_celsius") is None
    assert metric_value(text, "sentinel_policy_rule_active", rule="pcie_replay_rate", gpu="0") == 0
    assert metric_value(text, "sentinel_policy_rule_active", rule="thermal", gpu="0") is None
    everything = render([g], rule_active=active, detail="full")
    assert metric_value(everything, "sentinel_gpu_field_supported", gpu="0", field="temperature_celsius") == 1
    assert metric_value(everything, "sentinel_policy_rule_active", rule="thermal", gpu="0") == 1


def started(src: PcieAerSource) -> PcieAerSource:
    src.start()
    return src


def test_a_working_fallback_is_up_and_only_a_signal_with_no_path_is_down(tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    via_sysfs = started(PcieAerSource(use_ebpf=False, sysfs_root=devices))  # eBPF off: the sysfs counters
    blind = started(PcieAerSource(use_ebpf=False, sysfs_root=tmp_path / "missing"))
    never_started = PcieAerSource(use_ebpf=False, sysfs_root=devices)
    assert via_sysfs.health()["pcie_aer"].up
    for src in (blind, never_started):
        (health,) = src.health().values()
        assert not health.up and health.detail

    def exported(src: PcieAerSource) -> str:
        return render([], sources={**src.health(), "nvml": SourceHealth(up=True)})

    text = exported(via_sysfs)
    assert metric_value(text, "sentinel_source_up", source="pcie_aer", via="sysfs") == 1
    assert metric_value(text, "sentinel_source_up", source="nvml", via="nvml") == 1
    assert len([s for s in samples(text) if s.startswith("sentinel_source_up{")]) == 2  # one per signal
    assert metric_value(exported(blind), "sentinel_source_up", source="pcie_aer", via="none") == 0
    assert metric_value(exported(never_started), "sentinel_source_up", source="pcie_aer", via="none") == 0
