"""Golden ``/metrics``: what a daemon wired by the builder serves for 8 simulated GPUs, at
``detail = "fleet"`` (the default) and ``"full"``, compared byte for byte with
``tests/golden/metrics-<detail>.txt``.

The daemon is the real one (``sentinel.builder.build_daemon``: NVML simulated, the file backend,
the control channel), with the PCIe AER source reading a fixture sysfs tree and the Xid source
switched off (so no host kernel log reaches the fixture). Two polls: healthy, then faults. The
only values masked are durations (``*_duration_seconds``), which no run repeats.

After a deliberate change to the exposition, regenerate the fixtures and review their diff::

    SENTINEL_UPDATE_GOLDEN=1 python3 -m pytest -q tests/test_metrics_golden.py
    git diff tests/golden/
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_for

GOLDEN = Path(__file__).resolve().parent / "golden"
GPUS = 8
FAULTS = {2: ["ecc-sbe=+7", "pcie-replay=+3", "nvlink-crc=+11@1", "temp=71", "xid=13"],
          5: ["ecc-sbe=+1", "retired-sbe=+2"]}
DURATION = re.compile(r"^(sentinel_\w+_duration_seconds(?:\{[^}]*\})?) \S+$", re.M)
TIMESTAMP = re.compile(r"^(sentinel_\w+_timestamp_seconds(?:\{[^}]*\})?) \S+$", re.M)  # wall-clock times
REGENERATE = "SENTINEL_UPDATE_GOLDEN=1 python3 -m pytest -q tests/test_metrics_golden.py"


def render(tmp_path: Path, detail: str) -> str:
    """The text a scrape of the wired daemon gets after a healthy poll and a poll with FAULTS."""
    from sentinel import config
    from sentinel.builder import build_daemon
    from sentinel.sources import simulated
    from sentinel.sources.pcie_aer import PcieAerSource
    from sentinel.sources.xid import XidSource

    state = tmp_path / "gpus.json"
    simulated.write_state(state, simulated.healthy_state(GPUS))
    sysfs = tmp_path / "sys"
    bus = "0000:3a:00.0"  # GPU 2's PCI address, as sysfs spells it
    (sysfs / bus).mkdir(parents=True)
    aer = sysfs / bus / "aer_dev_correctable"
    aer.write_text("RxErr 0\nTOTAL_ERR_COR 0\n")
    cfg = config.parse(f'[daemon]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                       f'node_name = "golden"\n[metrics]\nlisten_address = "127.0.0.1"\nport = 0\ndetail = "{detail}"\n'
                       f'[ebpf]\nenabled = false\nkmsg_fallback = false\n'
                       # a rate rule trips or not by the wall-clock time between the two polls: off, so the
                       # fixture does not depend on how fast this machine polls (the counter stays exported)
                       f'[policy]\ndisabled_rules = ["pcie_replay_rate"]\n')
    sources = [XidSource(use_ebpf=False, kmsg_fallback=False), PcieAerSource(use_ebpf=False, sysfs_root=sysfs)]
    daemon = build_daemon(cfg, simulate=str(state), event_sources=sources)
    try:
        daemon.start()  # binds, first poll
        for gpu, faults in FAULTS.items():
            simulated.inject(state, gpu, faults)
        aer.write_text("RxErr 4\nTOTAL_ERR_COR 4\n")
        # The simulated driver delivers the Xid through its event thread: poll until every fault
        # shows (further polls change no counter: the faults are one-off increases).
        wait_for(lambda: daemon.poll_once() and seen_all(daemon), timeout=30, what="every injected fault in the readings")
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    finally:
        daemon.close()
    return TIMESTAMP.sub(r"\1 <timestamp>", DURATION.sub(r"\1 <duration>", text))


def seen_all(daemon) -> bool:
    """Whether the daemon's published view shows every fault of FAULTS and the AER errors."""
    from sentinel.sources.pcie_aer import PCIE_AER_ERRORS

    gpus = {g.index: g for g in daemon.view.readings.gpus}
    return (gpus[2].xid_counts.get(13) == 1 and gpus[2].values.get("temperature_celsius") == 71
            and gpus[5].values.get("retired_pages_sbe") == 2
            and daemon.view.counters.get(PCIE_AER_ERRORS.key(device="0000:3a:00.0", severity="correctable")) == 4)


def readable_diff(expected: str, actual: str, name: str) -> str:
    lines = difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"tests/golden/{name} (expected)",
                                 "/metrics (served now)", n=1, lineterm="")
    return "\n".join(lines)


@pytest.mark.parametrize("detail", ["fleet", "full"])
def test_metrics_match_the_golden_exposition(tmp_path, detail):
    actual = render(tmp_path, detail)
    path = GOLDEN / f"metrics-{detail}.txt"
    if os.environ.get("SENTINEL_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual)
    expected = path.read_text()
    assert actual == expected, (
        f"/metrics differs from {path.name} (- expected, + served now). If the change is meant, regenerate with "
        f"`{REGENERATE}` and commit the fixture diff; else fix the exporter.\n" + readable_diff(expected, actual, path.name))


@pytest.mark.parametrize("detail", ["fleet", "full"])
def test_golden_exposition_passes_promtool(detail):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is part of this machine's test setup (apt-get install prometheus)"
    text = (GOLDEN / f"metrics-{detail}.txt").read_text().replace("<duration>", "0.001").replace("<timestamp>", "1.7e9")
    r = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
