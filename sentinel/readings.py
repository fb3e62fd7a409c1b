"""Typed readings that flow from sources to the policy and the exporter (never backwards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from sentinel.fields import NVML_FIELDS, names

# Scalar per-GPU fields, in the order they are probed: the names of the declarations in
# sentinel/fields.py (declare a new field there). NVLink counters are kept apart (per link).
FIELDS: tuple[str, ...] = names(NVML_FIELDS)

NVLINK_KINDS: tuple[str, ...] = ("crc_flit", "crc_data", "replay", "recovery")


def sum_links(nvlink: Mapping[tuple[int, str], int]) -> dict[str, int]:
    """Each NVLink counter kind summed over the links (``GpuReading.nvlink`` -> ``nvlink_sums``)."""
    sums: dict[str, int] = {}
    get = sums.get
    for (_, kind), value in nvlink.items():
        sums[kind] = get(kind, 0) + value
    return sums


@dataclass(frozen=True)
class XidEvent:
    """One Xid report, from NVML's event set, the kernel log, or eBPF."""

    gpu: int | None  # index, or None when the bus id matches no GPU of this node
    xid: int
    source: str  # "nvml", "ebpf_xid", "kmsg"
    pci_bus_id: str = ""
    pid: int | None = None
    process: str = ""
    message: str = ""


@dataclass(frozen=True)
class KernelEvent:
    """A node-level kernel event other than an Xid: a fatal signal to a rank, a host memory
    error, a PCIe AER error."""

    kind: str  # "rank_signal", "mc_error", "aer"
    source: str
    detail: Mapping[str, object] = field(default_factory=dict)
    gpu: int | None = None


@dataclass(frozen=True)
class GpuReading:
    """One GPU at one poll.

    ``values`` holds only what was read successfully this poll; a field that is not supported
    on this GPU is in ``unsupported`` and never in ``values`` (never reported as 0). ``errors``
    maps a field that failed this poll to its NVML error code.
    """

    index: int
    uuid: str
    pci_bus_id: str
    name: str = ""
    serial: str = ""
    values: Mapping[str, float] = field(default_factory=dict)
    unsupported: frozenset[str] = frozenset()
    errors: Mapping[str, int] = field(default_factory=dict)
    nvlink: Mapping[tuple[int, str], int] = field(default_factory=dict)
    xid_counts: Mapping[int, int] = field(default_factory=dict)  # cumulative since daemon start
    lost: bool = False
    hung: bool = False  # an NVML call on this GPU passed its deadline
    # sum_links(nvlink), when the source made it where the counters were read (the NVML source's
    # reading thread, while they are in its cache); None: made on first use
    summed: Mapping[str, int] | None = field(default=None, compare=False, repr=False)

    @cached_property
    def nvlink_sums(self) -> Mapping[str, int]:
        """Each NVLink counter kind summed over the links: what the rules, the straggler causes and
        the default export use (summed once per reading, not once by each)."""
        return self.summed if self.summed is not None else sum_links(self.nvlink)


@dataclass(frozen=True)
class SourceHealth:
    up: bool
    poll_seconds: float = 0.0
    detail: str = ""


@dataclass(frozen=True)
class NodeReadings:
    """Everything the sources produced in one poll cycle."""

    time: float
    driver_version: str
    gpus: tuple[GpuReading, ...]
    xid_events: tuple[XidEvent, ...] = ()  # new since the previous poll, all sources
    sources: Mapping[str, SourceHealth] = field(default_factory=dict)
    nvml_errors: Mapping[tuple[str, int], int] = field(default_factory=dict)  # (field, code) -> count
    kernel_events: tuple[KernelEvent, ...] = ()  # new since the previous poll
    events_only: bool = False  # a kernel event arrived between polls: decide on events, not counters
