"""One Prometheus collector that renders the daemon's latest snapshot.

A scrape never calls NVML: it only reads the immutable :class:`View` the daemon published after
its last poll. Nothing is registered at import time; the daemon builds its own registry.

Cardinality is sized for a fleet (``detail = "fleet"``, the default; ``[metrics] detail`` in the
config): every series of a 2,048-node job is scraped every interval, so what no alert or
dashboard reads is left out.

* NVLink counters are summed per GPU by kind (``sentinel_gpu_nvlink_errors_total{kind}``); the
  per-link counters (``sentinel_gpu_nvlink_link_errors_total{link,kind}``) are exported only for
  links with a nonzero counter, to say which link is failing.
* ``sentinel_gpu_field_supported`` is exported only where it is 0 (NVML does not support the
  field on that GPU), and ``sentinel_policy_rule_active`` only where it is 0 (the rule cannot run
  on that GPU): an absent series means supported, active.
* ``sentinel_source_up{source,via}`` is one series per signal: 1 while the node sees it through
  ``via`` (``ebpf``, ``kmsg``, ``sysfs``, ``nvml``), 0 (``via="none"``) only when every path to it
  failed. A signal switched off in config is not a source of this node and is not exported.

``detail = "full"`` adds every link, and the 1s of both state metrics (about 1,100 series for
8 GPUs with 18 NVLink links each, against about 260).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sentinel import fields as nvml_fields
from sentinel.readings import NVLINK_KINDS, NodeReadings, SourceHealth

log = logging.getLogger("sentinel.metrics")


def _field_metrics() -> dict[str, tuple[str, str, dict[str, str], bool]]:
    """field -> (metric name, help, extra labels, counter?), from the NVML field declarations
    (read at each collect, so the collector always renders the table the source reads)."""
    return nvml_fields.metric_table(nvml_fields.NVML_FIELDS)


@dataclass(frozen=True)
class View:
    """Everything a scrape shows; replaced whole after each poll."""

    readings: NodeReadings | None = None
    health: Mapping[int, int] = field(default_factory=dict)  # gpu -> Health code
    predicted_failure_seconds: Mapping[int, float] = field(default_factory=dict)
    trips: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (rule, action) -> count
    rule_active: Mapping[tuple[str, int], bool] = field(default_factory=dict)
    counters: Mapping[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    gauges: Mapping[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    node: str = ""
    detail: str = "fleet"  # one of DETAIL_LEVELS: which series are rendered (module docstring)


DETAIL_LEVELS = ("fleet", "full")

COUNTER_HELP = {
    "sentinel_policy_trips": "Policy trips by rule and action",
    "sentinel_actions": "Actions carried out, by kind and outcome",
    "sentinel_channel_messages": "Control-channel messages by kind and outcome",
    "sentinel_ebpf_events_lost": "Events the kernel dropped before user space read them",
    "sentinel_kernel_events": "Kernel events seen, by source and kind",
    "sentinel_kmsg_malformed_lines": "Kernel log lines that looked like Xid reports but did not parse",
    "sentinel_config_reloads": "Config reloads by outcome",
    "sentinel_backend_calls": "Calls to the action backend (scheduler), by backend, operation and outcome (ok, retried, failed)",
    "sentinel_breaker_refusals": "Cordons the circuit breaker refused (too many nodes cordoned by Sentinel in the window)",
    "sentinel_backend_up": "1 when the last call to the action backend's scheduler answered, 0 when it did not",
    "sentinel_migration_steps": "Migration steps and their failures, by step",
    "sentinel_migration_deadline_exceeded": "Migrations that moved on (fail-safe) because a phase's backend step passed its deadline, by phase",
    "sentinel_spare_choices": "Spares chosen by topology, by distance to this node (nvlink, leaf, spine, ..., far, unknown)",
    "sentinel_node_cordoned": "1 while this node is cordoned by Sentinel",
}


class SentinelCollector(Collector):
    def __init__(self, view: Callable[[], View]) -> None:
        self._view = view
        self._undeclared: Counter[str] = Counter()  # values skipped: no field declaration says how to export them
        self._undeclared_lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        r = view.readings
        families: dict[str, Metric] = {}

        def family(name: str, help_: str, labels: list[str], counter: bool) -> Metric:
            if name not in families:
                cls = CounterMetricFamily if counter else GaugeMetricFamily
                families[name] = cls(name, help_, labels=labels)
            return families[name]

        full = view.detail == "full"
        base = ["gpu", "uuid"]
        up = family("sentinel_up", "1 while the daemon runs", [], False)
        up.add_metric([], 1.0)
        if r is not None:
            field_metrics = _field_metrics()
            omit_zero = {f.name for f in nvml_fields.NVML_FIELDS if f.omit_zero}
            info = family("sentinel_gpu_info", "GPU identity", base + ["pci_bus_id", "name", "serial", "driver_version"], False)
            supported = family("sentinel_gpu_field_supported", "0 where NVML reports the field not supported on this GPU", base + ["field"], False)
            lost = family("sentinel_gpu_lost", "1 when NVML reports the GPU lost (fallen off the bus)", base, False)
            hung = family("sentinel_gpu_nvml_hung", "1 when an NVML call on this GPU passed its deadline", base, False)
            for g in r.gpus:
                ids = [str(g.index), g.uuid]
                info.add_metric(ids + [g.pci_bus_id, g.name, g.serial, r.driver_version], 1.0)
                lost.add_metric(ids, float(g.lost))
                hung.add_metric(ids, float(g.hung))
                for fname in field_metrics:
                    if full or fname in g.unsupported:
                        supported.add_metric(ids + [fname], 0.0 if fname in g.unsupported else 1.0)
                for fname, value in g.values.items():
                    if value == 0 and fname in omit_zero and not full:
                        continue  # e.g. the recovery action "none": absent means nothing to do
                    if fname not in field_metrics:
                        self._skip_undeclared(fname)  # one bad field never fails the scrape
                        continue
                    mname, help_, extra, counter = field_metrics[fname]
                    m = family(mname, help_, base + list(extra), counter)
                    m.add_metric(ids + list(extra.values()), value)
                if g.nvlink:
                    self._nvlink(family, ids, g.nvlink, full)
                xid = family("sentinel_gpu_xid_errors", "Xid errors per Xid code since the daemon started", base + ["xid"], True)
                for code, count in sorted(g.xid_counts.items()):
                    xid.add_metric(ids + [str(code)], float(count))
                health = family("sentinel_gpu_health", "0 healthy, 1 watch, 2 predicted failure, 3 failed", base, False)
                if g.index in view.health:
                    health.add_metric(ids, float(view.health[g.index]))
                pred = family("sentinel_gpu_predicted_failure_seconds", "Forecast seconds until a counter crosses its failure threshold", base, False)
                if g.index in view.predicted_failure_seconds:
                    pred.add_metric(ids, view.predicted_failure_seconds[g.index])
            src_up = family("sentinel_source_up", "1: the node sees this signal through via; 0: blind to it", ["source", "via"], False)
            src_dur = family("sentinel_source_poll_duration_seconds", "Duration of the source's last poll", ["source"], False)
            for name, health in sorted(r.sources.items()):
                src_up.add_metric([name, source_via(name, health)], float(health.up))
                src_dur.add_metric([name], health.poll_seconds)
            errs = family("sentinel_nvml_errors", "NVML call failures by field and NVML return code", ["field", "code"], True)
            for (fname, code), count in sorted(r.nvml_errors.items()):
                errs.add_metric([fname, str(code)], float(count))
        with self._undeclared_lock:
            undeclared = sorted(self._undeclared.items())
        if undeclared:
            skipped = family("sentinel_exporter_unknown_fields", "Field values left out of the export: no NVML field declaration names them", ["field"], True)
            for fname, count in undeclared:
                skipped.add_metric([fname], float(count))
        trips = family("sentinel_policy_trips", COUNTER_HELP["sentinel_policy_trips"], ["rule", "action"], True)
        for (rule, action), count in sorted(view.trips.items()):
            trips.add_metric([rule, action], float(count))
        inactive = {k: v for k, v in view.rule_active.items() if full or not v}
        if inactive:
            act = family("sentinel_policy_rule_active", "0 where a rule cannot run on this GPU (its inputs are unsupported)", ["rule", "gpu"], False)
            for (rule, gpu), active in sorted(inactive.items()):
                act.add_metric([rule, str(gpu)], float(active))
        for store, counter in ((view.counters, True), (view.gauges, False)):
            for (name, labels), value in sorted(store.items()):
                m = family(name, COUNTER_HELP.get(name, name.replace("_", " ")), [k for k, _ in labels], counter)
                m.add_metric([v for _, v in labels], value)
        yield from (m for m in families.values() if m.samples)  # no HELP/TYPE lines for an empty family

    @staticmethod
    def _nvlink(family: Callable[..., Metric], ids: list[str], counters: Mapping[tuple[int, str], int], full: bool) -> None:
        """Per GPU, each kind summed over its links (what a rate or alert needs); per link only
        where a counter is nonzero (which link is failing), or for every link with ``full``."""
        sums: Counter[str] = Counter()
        for (_, kind), value in counters.items():
            sums[kind] += value
        total = family("sentinel_gpu_nvlink_errors", "NVLink data-link errors, summed over the GPU's links", ["gpu", "uuid", "kind"], True)
        for kind in sorted(sums, key=lambda k: (NVLINK_KINDS.index(k) if k in NVLINK_KINDS else len(NVLINK_KINDS), k)):
            total.add_metric(ids + [kind], float(sums[kind]))
        links = {link for (link, _), value in counters.items() if full or value}
        if not links:
            return
        per_link = family("sentinel_gpu_nvlink_link_errors", "NVLink data-link error counters per link (links with errors; every link with detail full)",
                          ["gpu", "uuid", "link", "kind"], True)
        for (link, kind), value in sorted(counters.items()):
            if link in links:
                per_link.add_metric(ids + [str(link), kind], float(value))

    def _skip_undeclared(self, fname: str) -> None:
        with self._undeclared_lock:
            first = fname not in self._undeclared
            self._undeclared[fname] += 1
        if first:
            log.error("reading field %r has no NVML field declaration (sentinel/fields.py): not exported", fname)


def source_via(name: str, health: SourceHealth) -> str:
    """The ``via`` label of one signal: the path its health names (the kernel-event sources'
    :class:`~sentinel.sources.kernel.SignalHealth`); a source with one path (NVML) is read
    through itself; ``none`` when it is down."""
    if not health.up:
        return "none"
    return getattr(health, "via", "") or name


def build_registry(view: Callable[[], View]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SentinelCollector(view))
    return registry
