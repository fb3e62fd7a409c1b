"""PCI bus ids, in one spelling: NVML reports ``00000000:3B:00.0``, the kernel logs ``0000:3b:00.0``
or ``0000:3b:00`` (older drivers: ``3b:00``). Everything Sentinel compares is ``0000:3b:00.0``."""

from __future__ import annotations

import re
from pathlib import Path

_PCI_NAME = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def normalize_bus_id(bus_id: str) -> str:
    """The canonical ``dddd:bb:dd.f`` form; text that is not a bus id comes back lower-cased, stripped."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, devfn = parts
        domain = domain[-4:].rjust(4, "0")
    elif len(parts) == 2:
        domain, (bus, devfn) = "0000", parts
    else:
        return text
    if "." not in devfn:
        devfn += ".0"
    return f"{domain}:{bus.rjust(2, '0')}:{devfn}"


def upstream_ports(bus_id: str, devices: Path = Path("/sys/bus/pci/devices")) -> list[str]:
    """The PCIe ports between ``bus_id`` and its root complex, nearest first (``0000:3a:00.0``'s
    switch downstream port, the switch's upstream port, the root port), from the device's sysfs
    path (``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/.../0000:3a:00.0``). An AER error a
    port reports about its link concerns the device below it. [] when sysfs has no such device."""
    try:
        real = (devices / normalize_bus_id(bus_id)).resolve(strict=True)
    except OSError:
        return []
    ports = [p.name for p in real.parents if _PCI_NAME.fullmatch(p.name)]
    return ports


def port_map(bus_to_gpu: dict[str, int], devices: Path = Path("/sys/bus/pci/devices")) -> dict[str, int]:
    """Upstream port -> GPU, for the ports above exactly one GPU of ``bus_to_gpu`` (a port above
    several GPUs, a root port of a shared switch, names no single GPU: its events are node events)."""
    above: dict[str, set[int]] = {}
    for bus, gpu in bus_to_gpu.items():
        for port in upstream_ports(bus, devices):
            above.setdefault(port, set()).add(gpu)
    return {port: next(iter(gpus)) for port, gpus in above.items() if len(gpus) == 1 and port not in bus_to_gpu}
