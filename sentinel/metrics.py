"""One Prometheus collector that renders the daemon's latest snapshot.

A scrape never calls NVML: it only reads the immutable :class:`View` the daemon published after
its last poll. Nothing is registered at import time; the daemon builds its own registry.

Every family it renders is declared (:mod:`sentinel.families`): those of the View's typed parts
here, the NVML fields' in :mod:`sentinel.fields`, and the View's ``counters`` and ``gauges`` by the
components that count them, handed in by the daemon (``build_registry(view, families)``). A
sample no family declares is left out and counted, never exported with a made-up help text.
Every family is listed in ``docs/metrics.md``.

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
from typing import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sentinel import fields as nvml_fields
from sentinel.families import Family, counter, gauge
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

# The families this collector renders from the View's typed parts (the per-GPU NVML fields are
# declared in sentinel.fields; the View's counters and gauges by the components that count them).
UP = gauge("sentinel_up", "1 while the daemon runs")
GPU_INFO = gauge("sentinel_gpu_info", "GPU identity", "gpu", "uuid", "pci_bus_id", "name", "serial", "driver_version")
GPU_FIELD_SUPPORTED = gauge("sentinel_gpu_field_supported", "0 where NVML reports the field not supported on this GPU",
                            "gpu", "uuid", "field")
GPU_LOST = gauge("sentinel_gpu_lost", "1 when NVML reports the GPU lost (fallen off the bus)", "gpu", "uuid")
GPU_NVML_HUNG = gauge("sentinel_gpu_nvml_hung", "1 when an NVML call on this GPU passed its deadline", "gpu", "uuid")
GPU_XID_ERRORS = counter("sentinel_gpu_xid_errors", "Xid errors per Xid code since the daemon started", "gpu", "uuid", "xid")
GPU_HEALTH = gauge("sentinel_gpu_health", "0 healthy, 1 watch, 2 predicted failure, 3 failed", "gpu", "uuid")
GPU_PREDICTED_FAILURE = gauge("sentinel_gpu_predicted_failure_seconds",
                              "Forecast seconds until a counter crosses its failure threshold", "gpu", "uuid")
GPU_NVLINK_ERRORS = counter("sentinel_gpu_nvlink_errors", "NVLink errors summed over the GPU's links",
                            "gpu", "uuid", "kind")
GPU_NVLINK_LINK_ERRORS = counter(
    "sentinel_gpu_nvlink_link_errors", "NVLink errors per link (links with errors)",
    "gpu", "uuid", "link", "kind")
SOURCE_UP = gauge("sentinel_source_up", "1: the node sees this signal through via; 0: blind to it", "source", "via")
SOURCE_POLL_DURATION = gauge("sentinel_source_poll_duration_seconds", "Duration of the source's last poll", "source")
NVML_ERRORS = counter("sentinel_nvml_errors", "NVML call failures by field and NVML return code", "field", "code")
UNKNOWN_FIELDS = counter("sentinel_exporter_unknown_fields",
                         "Field values left out of the export: no NVML field declaration names them", "field")
UNDECLARED_SAMPLES = counter("sentinel_exporter_undeclared_samples",
                             "Samples left out of the export: no metric family declares their name and labels", "name")
POLICY_TRIPS = counter("sentinel_policy_trips", "Policy trips by rule and action", "rule", "action")
POLICY_RULE_ACTIVE = gauge("sentinel_policy_rule_active", "0 where a rule cannot run on this GPU (its inputs are unsupported)",
                           "rule", "gpu")
FAMILIES = (UP, GPU_INFO, GPU_FIELD_SUPPORTED, GPU_LOST, GPU_NVML_HUNG, GPU_XID_ERRORS, GPU_HEALTH, GPU_PREDICTED_FAILURE,
            GPU_NVLINK_ERRORS, GPU_NVLINK_LINK_ERRORS, SOURCE_UP, SOURCE_POLL_DURATION, NVML_ERRORS, UNKNOWN_FIELDS,
            UNDECLARED_SAMPLES, POLICY_TRIPS, POLICY_RULE_ACTIVE)


def new_metric(family: Family, labels: list[str] | None = None) -> Metric:
    """An empty prometheus_client family for ``family`` (its declared labels unless given)."""
    cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
    return cls(family.name, family.help, labels=list(family.labels) if labels is None else labels)


class _Families(dict):
    """name -> the prometheus_client family being filled in one collect, in first-use order."""

    def of(self, decl: Family) -> Metric:
        if decl.name not in self:
            self[decl.name] = new_metric(decl)
        return self[decl.name]

    def field(self, name: str, help_: str, labels: list[str], counter_: bool) -> Metric:
        if name not in self:
            cls = CounterMetricFamily if counter_ else GaugeMetricFamily
            self[name] = cls(name, help_, labels=labels)
        return self[name]


class SentinelCollector(Collector):
    """Renders a :class:`View`. ``families`` declares the names the View's ``counters`` and
    ``gauges`` may carry (see :mod:`sentinel.families`); a sample no family declares (name, or
    labels other than the declared ones) is left out, logged once and counted."""

    def __init__(self, view: Callable[[], View], families: Iterable[Family] = ()) -> None:
        self._view = view
        self._declared: dict[str, Family] = {}
        for f in families:
            if self._declared.setdefault(f.name, f) != f:
                raise ValueError(f"metric family {f.name} is declared twice, differently")
        self._undeclared: Counter[str] = Counter()  # values skipped: no field declaration says how to export them
        self._undeclared_samples: Counter[str] = Counter()  # samples skipped: no family declares them
        self._undeclared_lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        view = self._view()
        r = view.readings
        families = _Families()
        full = view.detail == "full"
        families.of(UP).add_metric([], 1.0)
        if r is not None:
            self._gpus(families, r, view, full)
            self._sources(families, r)
        self._skipped(families)
        trips = families.of(POLICY_TRIPS)
        for (rule, action), count in sorted(view.trips.items()):
            trips.add_metric([rule, action], float(count))
        inactive = {k: v for k, v in view.rule_active.items() if full or not v}
        if inactive:
            act = families.of(POLICY_RULE_ACTIVE)
            for (rule, gpu), active in sorted(inactive.items()):
                act.add_metric([rule, str(gpu)], float(active))
        for store in (view.counters, view.gauges):
            self._store(families, store)
        self._skipped_samples(families)
        yield from (m for m in families.values() if m.samples)  # no HELP/TYPE lines for an empty family

    def _gpus(self, families: _Families, r: NodeReadings, view: View, full: bool) -> None:
        field_metrics = _field_metrics()
        omit_zero = {f.name for f in nvml_fields.NVML_FIELDS if f.omit_zero}
        base = ["gpu", "uuid"]
        info = families.of(GPU_INFO)
        supported = families.of(GPU_FIELD_SUPPORTED)
        lost = families.of(GPU_LOST)
        hung = families.of(GPU_NVML_HUNG)
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
                mname, help_, extra, counter_ = field_metrics[fname]
                m = families.field(mname, help_, base + list(extra), counter_)
                m.add_metric(ids + list(extra.values()), value)
            if g.nvlink:
                self._nvlink(families, ids, g.nvlink, g.nvlink_sums, full)
            xid = families.of(GPU_XID_ERRORS)
            for code, count in sorted(g.xid_counts.items()):
                xid.add_metric(ids + [str(code)], float(count))
            health = families.of(GPU_HEALTH)
            if g.index in view.health:
                health.add_metric(ids, float(view.health[g.index]))
            pred = families.of(GPU_PREDICTED_FAILURE)
            if g.index in view.predicted_failure_seconds:
                pred.add_metric(ids, view.predicted_failure_seconds[g.index])

    @staticmethod
    def _sources(families: _Families, r: NodeReadings) -> None:
        src_up = families.of(SOURCE_UP)
        src_dur = families.of(SOURCE_POLL_DURATION)
        for name, health in sorted(r.sources.items()):
            src_up.add_metric([name, source_via(name, health)], float(health.up))
            src_dur.add_metric([name], health.poll_seconds)
        errs = families.of(NVML_ERRORS)
        for (fname, code), count in sorted(r.nvml_errors.items()):
            errs.add_metric([fname, str(code)], float(count))

    def _skipped(self, families: _Families) -> None:
        with self._undeclared_lock:
            undeclared = sorted(self._undeclared.items())
        if undeclared:
            skipped = families.of(UNKNOWN_FIELDS)
            for fname, count in undeclared:
                skipped.add_metric([fname], float(count))

    def _skipped_samples(self, families: _Families) -> None:
        with self._undeclared_lock:
            samples = sorted(self._undeclared_samples.items())
        if samples:
            skipped = families.of(UNDECLARED_SAMPLES)
            for name, count in samples:
                skipped.add_metric([name], float(count))

    def _store(self, families: _Families, store: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        for (name, labels), value in sorted(store.items()):
            decl = self._declared.get(name)
            if decl is None or tuple(k for k, _ in labels) != decl.labels:
                self._skip_sample(name, labels, decl)
                continue
            families.of(decl).add_metric([v for _, v in labels], value)

    @staticmethod
    def _nvlink(families: _Families, ids: list[str], counters: Mapping[tuple[int, str], int], sums: Mapping[str, int],
                full: bool) -> None:
        """Per GPU, each kind summed over its links (what a rate or alert needs); per link only
        where a counter is nonzero (which link is failing), or for every link with ``full``."""
        total = families.of(GPU_NVLINK_ERRORS)
        for kind in sorted(sums, key=lambda k: (NVLINK_KINDS.index(k) if k in NVLINK_KINDS else len(NVLINK_KINDS), k)):
            total.add_metric(ids + [kind], float(sums[kind]))
        links = {link for (link, _), value in counters.items() if full or value}
        if not links:
            return
        per_link = families.of(GPU_NVLINK_LINK_ERRORS)
        for (link, kind), value in sorted(counters.items()):
            if link in links:
                per_link.add_metric(ids + [str(link), kind], float(value))

    def _skip_undeclared(self, fname: str) -> None:
        with self._undeclared_lock:
            first = fname not in self._undeclared
            self._undeclared[fname] += 1
        if first:
            log.error("reading field %r has no NVML field declaration (sentinel/fields.py): not exported", fname)

    def _skip_sample(self, name: str, labels: tuple[tuple[str, str], ...], decl: Family | None) -> None:
        with self._undeclared_lock:
            first = name not in self._undeclared_samples
            self._undeclared_samples[name] += 1
        if first:
            why = ("no metric family declares it (declare it with sentinel.families.counter/gauge in the module that "
                   "counts it, and list it in that component's FAMILIES)" if decl is None
                   else f"its labels {[k for k, _ in labels]} are not the declared {list(decl.labels)}")
            log.error("metric sample %s not exported: %s", name, why)


def source_via(name: str, health: SourceHealth) -> str:
    """The ``via`` label of one signal: the path its health names (the kernel-event sources'
    :class:`~sentinel.sources.kernel.SignalHealth`); a source with one path (NVML) is read
    through itself; ``none`` when it is down."""
    if not health.up:
        return "none"
    return getattr(health, "via", "") or name


def build_registry(view: Callable[[], View], families: Iterable[Family] = ()) -> CollectorRegistry:
    """A registry holding one :class:`SentinelCollector`; ``families`` declares the View's
    counters and gauges (:meth:`sentinel.daemon.Daemon.metric_families`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SentinelCollector(view, families))
    return registry
