"""The daemon's image with the host's kernel, as the DaemonSet mounts it: privileged (the host's
/dev, so /dev/kmsg), /sys/kernel/tracing, /lib/modules and /usr/src (bcc compiles the probes in
the container against the host's headers), read-only root file system. An Xid line written to the
host's kernel log reaches the daemon in the container through its eBPF probe. In the "kernel"
group (conftest.KERNEL_FILES): it writes to the host's kernel log."""

from __future__ import annotations

import secrets
import urllib.request

import pytest

from conftest import metric_value, require_ebpf, wait_for
from oci_image import REF, build_image, missing, podman_store
from sentinel_tools.ports import free_port

pytestmark = [pytest.mark.needs_root, pytest.mark.needs_ebpf, pytest.mark.slow]
XID79_GPU1 = "NVRM: Xid (PCI:0000:2a:00): 79, pid=4242, name=python3, GPU has fallen off the bus."


def test_an_xid_in_the_host_kernel_log_reaches_the_container_through_ebpf(kmsg_writer, sim_state, tmp_path):
    why = missing()
    if why:
        pytest.skip(f"the image test needs {why}")
    require_ebpf()
    archive = build_image()
    podman = podman_store()
    try:
        podman.load(archive)
        (tmp_path / "run").mkdir()
        (tmp_path / "state").mkdir()
        port = free_port()
        name = f"sntl-img-{secrets.token_hex(4)}"
        podman.run(name, "--privileged", "--read-only", "--network", "host",
                   "-v", "/sys/kernel/tracing:/sys/kernel/tracing", "-v", "/lib/modules:/lib/modules:ro",
                   "-v", "/usr/src:/usr/src:ro", "-v", f"{sim_state.parent}:/sim",
                   "-v", f"{tmp_path / 'run'}:/run/sentinel", "-v", f"{tmp_path / 'state'}:/var/lib/sentinel",
                   REF, "run", "--simulate", f"/sim/{sim_state.name}", "--port", str(port), "--listen-address", "127.0.0.1")

        def scrape():
            assert podman("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "true", podman.logs(name)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    return resp.read().decode()
            except OSError:
                return None

        def first_poll():  # status.json: the daemon has polled (its probes compiled and attached)
            t = scrape() if (tmp_path / "run" / "status.json").exists() else None
            return t if t and "sentinel_source_up{" in t else None

        text = wait_for(first_poll, timeout=180, interval=1, what="the container's first poll (after the probes compile)")
        assert metric_value(text, "sentinel_source_up", source="xid", via="ebpf") == 1, text + podman.logs(name)
        kmsg_writer(XID79_GPU1)

        def counted():
            t = scrape()
            return t if t and metric_value(t, "sentinel_gpu_xid_errors_total", gpu="1", xid="79") == 1 else None

        text = wait_for(counted, timeout=30, interval=0.5, what="the Xid 79 counted by the container's daemon")
        assert metric_value(text, "sentinel_gpu_health", gpu="1") == 3
        assert metric_value(text, "sentinel_policy_trips_total", rule="xid", action="migrate") == 1
    finally:
        podman.close()
