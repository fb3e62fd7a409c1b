"""``kernel_log``: a kernel message of the signature catalog (``sentinel/signatures.toml``)."""

from __future__ import annotations

from sentinel.rules.base import Finding, NodeRule

# Kinds that mean the same condition as another rule's source, so that the two share a cooldown:
# an EDAC UE line and the ras:mc_event probe's uncorrected event are one host memory error.
SHARED_CAUSE = {"host_memory_ue": "host_memory:uncorrected"}


class KernelLog(NodeRule):
    """A kernel-log signature other than an Xid (those go to the ``xid`` rule) → the catalog's
    action: fallen off the bus without an Xid, GSP timeouts, RmInitAdapter failures and
    reset-required assertions → ``migrate``; uncorrected host memory (EDAC UE), machine-check
    exceptions, fatal APEI/GHES errors and uncorrected PCIe AER → ``snapshot``; NVSwitch SXids →
    ``alert`` (``migrate`` when fatal). The event is the GPU's when the message names its bus id
    or the PCIe port above it, else the node's. Corrected errors (severity ``info``) are counted
    (``sentinel_kernel_events_total{kind}``) and trip nothing.

    Source: each catalog entry names its own (driver strings, NVIDIA documents, issue threads)."""

    name = "kernel_log"
    order = 630

    def evaluate(self, event, cfg):
        d = event.detail
        if event.kind != "kernel_log" or d.get("severity") == "info" or d.get("action") not in ("alert", "snapshot", "migrate"):
            return None
        where = f"GPU {event.gpu}" if event.gpu is not None else "node"
        cause = SHARED_CAUSE.get(str(d.get("kind")), f"{self.name}:{d.get('kind')}:{event.gpu if event.gpu is not None else 'node'}")
        values = {"count": float(d["count"])} if isinstance(d.get("count"), int) else {}
        return Finding(str(d["action"]), cause, f"kernel log: {d.get('kind')} on {where}: {d.get('message')}", values)


RULE = KernelLog()
