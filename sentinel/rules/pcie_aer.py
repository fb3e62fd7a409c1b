"""``pcie_aer``: a PCIe AER error on a GPU's device."""

from __future__ import annotations

from sentinel.rules.base import Finding, NodeRule, event_values


class PcieAer(NodeRule):
    """A ``nonfatal`` or ``fatal`` PCIe Advanced Error Reporting error on a GPU's PCIe device →
    ``snapshot``. Correctable errors, and errors on devices that are not a GPU of this node, are
    ignored.

    Source: the PCIe AER severities as the kernel's ``aer_event`` tracepoint reports them."""

    name = "pcie_aer"
    order = 620

    def evaluate(self, event, cfg):
        d = event.detail
        if event.kind != "aer" or d.get("severity") not in ("nonfatal", "fatal") or event.gpu is None:
            return None
        return Finding("snapshot", f"{self.name}:{event.gpu}:{d.get('severity')}",
                       f"PCIe AER {d.get('severity')} error on {d.get('device')} (GPU {event.gpu})",
                       event_values(event))


RULE = PcieAer()
