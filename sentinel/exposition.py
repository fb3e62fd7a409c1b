"""The Prometheus text format (0.0.4) of a list of metric families, byte for byte what
``prometheus_client.exposition.generate_latest`` renders (names escaped as its default,
``underscores``, does), at a fraction of its CPU.

generate_latest checks and escapes every label and metric name of every sample (a regular
expression each), sorts and escapes every sample's labels and formats every value: ~5 µs a sample,
~10 ms for the ~2,000 samples of a 64-GPU node, every scrape. The same series come back every
scrape, so here each series' start (``name{labels} ``, made by prometheus_client's own escaping
functions, labels sorted, values escaped as generate_latest escapes them) and each value's text
(prometheus_client's own ``floatToGoString``) are made once and kept (bounded).
tests/test_exposition.py compares both renders.
"""

from __future__ import annotations

import math
from typing import Iterable

from prometheus_client.core import Metric
from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# OpenMetrics-only samples: generate_latest puts them in a gauge of their own after the family
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
# OpenMetrics type -> (suffix of the family's name, type in the text format)
_TYPES = {"counter": ("_total", "counter"), "info": ("_info", "gauge"), "stateset": ("", "gauge"),
          "gaugehistogram": ("", "histogram"), "unknown": ("", "untyped")}
_NAMES_MAX = 4096  # names held (they come from declarations: a few hundred)
_SERIES_MAX = 65536  # series starts and value texts held (a 64-GPU node's full export: ~9,000 series)


class Snapshot:
    """Collected families that the prometheus_client encoders can render (any number of times)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self.families)


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class TextRenderer:
    """Renders metric families in the text format. Keeps what repeats from one render to the next:
    each series' ``name{labels} `` (the same series come back every scrape) and each value's text."""

    def __init__(self) -> None:
        self._names: dict[str, str] = {}
        self._heads: dict[tuple, str] = {}
        self._values: dict[float, str] = {}

    def _name(self, name: str) -> str:
        escaped = self._names.get(name)
        if escaped is None:
            if len(self._names) >= _NAMES_MAX:
                self._names.clear()
            escaped = self._names[name] = escape_metric_name(name, UNDERSCORES)
        return escaped

    def _head(self, name: str, labels: dict[str, str]) -> str:
        """``name{a="x",b="y"} `` (labels sorted by name), as generate_latest writes a sample's start."""
        key = (name, *labels.items())
        head = self._heads.get(key)
        if head is None:
            if len(self._heads) >= _SERIES_MAX:
                self._heads.clear()
            labelstr = ",".join('{}="{}"'.format(escape_label_name(k, UNDERSCORES),
                                                  v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"'))
                                for k, v in sorted(labels.items()))
            head = self._heads[key] = f"{self._name(name)}{{{labelstr}}} " if labelstr else f"{self._name(name)} "
        return head

    def _value(self, value: float) -> str:
        if value == 0:  # most values; 0.0 and -0.0 are one key, and two texts
            return "0.0" if math.copysign(1.0, value) > 0 else "-0.0"
        text = self._values.get(value)
        if text is None:
            if len(self._values) >= _SERIES_MAX:
                self._values.clear()
            text = self._values[value] = floatToGoString(value)
        return text

    def _line(self, sample: Sample) -> str:
        stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
        return f"{self._head(sample.name, sample.labels)}{self._value(sample.value)}{stamp}\n"

    def render(self, metrics: Iterable[Metric]) -> bytes:
        """The text format of ``metrics``, in order (raises what generate_latest would, with the
        family appended to the exception's args)."""
        output: list[str] = []
        for metric in metrics:
            om_samples: dict[str, list[str]] = {}
            try:
                suffix, mtype = _TYPES.get(metric.type, ("", metric.type))
                mname = self._name(metric.name + suffix)
                output.append(f"# HELP {mname} {_help(metric.documentation)}\n# TYPE {mname} {mtype}\n")
                om_names = {metric.name + s: s for s in _OM_SUFFIXES}
                for s in metric.samples:
                    om = om_names.get(s.name)
                    if om is None:
                        output.append(self._line(s))
                    else:
                        om_samples.setdefault(om, []).append(self._line(s))
            except Exception as exc:
                exc.args = (exc.args or ("",)) + (metric,)
                raise
            for om, lines in sorted(om_samples.items()):
                name = self._name(metric.name + om)
                output.append(f"# HELP {name} {_help(metric.documentation)}\n# TYPE {name} gauge\n")
                output.extend(lines)
        return "".join(output).encode("utf-8")
