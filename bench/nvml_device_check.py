"""One short check of the real NVML path on a machine with NVIDIA GPUs (the `device` tool's H200,
or any GPU node). Prints, per GPU: identity, which fields NVML supports, their values, NVLink
links found, and the poll cost; then runs the daemon for a few seconds on real NVML and checks
its /metrics with promtool when available. Exits non-zero if NVML cannot start.

    python bench/nvml_device_check.py [--seconds 5] [--json PATH] [--smoke]

``--smoke`` (no GPU needed; what the suite runs): the same code path against the project's fake
pynvml (tests/fake_pynvml.py, 2 healthy GPUs) instead of the real library, and the daemon on
simulated GPUs (``--simulate``) for 1 s. Its figures prove the bench runs, not what NVML costs;
only a run on a GPU node measures that.

``--json`` figures: ``gpus_count``, ``poll_median_seconds``, ``poll_max_seconds``,
``nvml_errors_count``, ``exposition_lines_count``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
import pynvml  # noqa: E402

from sentinel.readings import FIELDS  # noqa: E402
from sentinel.sources.nvml import NvmlSource, NvmlUnavailable  # noqa: E402


SMOKE_FIGURES = ("gpus_count", "poll_median_seconds", "poll_max_seconds", "nvml_errors_count", "exposition_lines_count")


def fake_nvml():
    """The project's fake pynvml (tests/fake_pynvml.py): the --smoke stand-in for a GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fake_pynvml import FakePynvml
    return FakePynvml(gpus=2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.seconds = 1.0
    src = NvmlSource(fake_nvml() if args.smoke else pynvml, deadline_seconds=2.0)
    try:
        src.start()
    except NvmlUnavailable as exc:
        print(f"NVML unavailable: {exc}")
        return 2
    print(f"driver {src.driver_version}, {len(src.gpus)} GPUs")
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        readings = src.poll()
        times.append(time.perf_counter() - t0)
    for g, r in zip(src.gpus, readings):
        print(f"GPU {r.index} {r.name} {r.uuid} bus {r.pci_bus_id} serial {r.serial}")
        print(f"  unsupported: {sorted(r.unsupported) or '-'}; errors: {dict(r.errors) or '-'}; nvlinks: {g.nvlinks}")
        print("  " + ", ".join(f"{f}={r.values[f]:g}" for f in FIELDS if f in r.values))
    print(f"poll of all GPUs: median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")
    print(f"NVML errors: {dict(src.errors) or 'none'}")
    figures = {"gpus_count": len(src.gpus), "poll_median_seconds": statistics.median(times), "poll_max_seconds": max(times),
               "nvml_errors_count": sum(src.errors.values())}
    src.close()
    with tempfile.TemporaryDirectory() as d:
        sim: list[str] = []
        if args.smoke:  # no GPU: the daemon on simulated GPUs
            from sentinel.sources import simulated
            simulated.write_state(Path(d) / "gpus.json", simulated.healthy_state(2))
            sim = ["--simulate", f"{d}/gpus.json"]
        proc = subprocess.Popen([sys.executable, "-m", "sentinel", "run", "--runtime-dir", f"{d}/run", "--state-dir",
                                 f"{d}/state", "--port", "0", "--listen-address", "127.0.0.1", "--no-ebpf", *sim],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            status = Path(d) / "run" / "status.json"
            end = time.time() + 30
            while not status.exists() and time.time() < end and proc.poll() is None:
                time.sleep(0.1)
            time.sleep(args.seconds)
            port = json.loads(status.read_text())["metrics_port"]
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            print(f"daemon on real NVML: {len(text.splitlines())} exposition lines")
            figures["exposition_lines_count"] = len(text.splitlines())
            promtool = shutil.which("promtool")
            if promtool:
                r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
                print(f"promtool check metrics: rc={r.returncode} {r.stdout.strip()} {r.stderr.strip()}")
            subprocess.run([sys.executable, "-m", "sentinel", "status", "--runtime-dir", f"{d}/run"])
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
            print("daemon log tail:\n" + "\n".join(out.splitlines()[-5:]))
    _report.write(args.json, "nvml_device_check", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
