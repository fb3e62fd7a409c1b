"""PCI bus ids, in one spelling: NVML reports ``00000000:3B:00.0``, the kernel logs ``0000:3b:00.0``
or ``0000:3b:00`` (older drivers: ``3b:00``). Everything Sentinel compares is ``0000:3b:00.0``."""

from __future__ import annotations


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
