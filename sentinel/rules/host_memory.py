"""``host_memory``: an uncorrected host memory-controller error (eBPF ``ras:mc_event``)."""

from __future__ import annotations

from sentinel.rules.base import Finding, NodeRule, event_values


class HostMemory(NodeRule):
    """An ``uncorrected`` or ``fatal`` error on a host memory controller → ``snapshot``: the host
    may die next, so save progress while it can. Corrected errors are ignored.

    Source: the kernel's EDAC ``ras:mc_event`` tracepoint (error type as EDAC reports it)."""

    name = "host_memory"
    order = 610

    def evaluate(self, event, cfg):
        d = event.detail
        if event.kind != "mc_error" or d.get("type") not in ("uncorrected", "fatal"):
            return None
        return Finding("snapshot", f"{self.name}:{d.get('type')}",
                       f"{d.get('count')} {d.get('type')} host memory error(s) on memory controller {d.get('mc')}",
                       event_values(event))


RULE = HostMemory()
