"""A Prometheus metric family, declared once, next to the code that counts it.

Every family Sentinel exports is a :class:`Family` constant in the module that owns the number
(``sentinel/channel.py`` declares ``sentinel_channel_messages``, ``sentinel/sources/xid.py``
``sentinel_kmsg_malformed_lines``, ...); a class that reports samples lists its families in a
``FAMILIES`` attribute, and the daemon hands the families of what it wired to the collector
(:func:`sentinel.metrics.build_registry`), which takes name, type, help and labels from them. A
sample whose name no family declares is not exported (the collector logs it and counts it in
``sentinel_exporter_undeclared_samples_total``); ``tests/test_metric_families.py`` fails first.

A sample is keyed ``(name, ((label, value), ...))``; :meth:`Family.key` makes that key with the
labels in their declared order and refuses labels the family does not declare. The per-GPU NVML
fields declare their metric in :mod:`sentinel.fields` (:func:`sentinel.fields.families`).

This module imports nothing of Sentinel's, so any module can declare a family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

COUNTER, GAUGE = "counter", "gauge"
LabelKey = tuple[str, tuple[tuple[str, str], ...]]

_NAME = re.compile(r"^sentinel_[a-z0-9]+(_[a-z0-9]+)*$")
_LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
# Units that are not base units (Prometheus: seconds, bytes, celsius, watts, ratios 0..1).
_NOT_BASE_UNITS = ("_milliseconds", "_ms", "_microseconds", "_minutes", "_hours", "_kilobytes", "_megabytes",
                   "_kib", "_mib", "_gib", "_milliwatts", "_percent", "_fahrenheit")


@dataclass(frozen=True)
class Family:
    """One metric family: ``name`` as declared (a counter's exposed name adds ``_total``), its type,
    its help text and its label names in the order samples carry them."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        """The name a scrape shows (``_total`` added to a counter's name)."""
        return f"{self.name}_total" if self.kind == COUNTER else self.name

    def key(self, **labels: Any) -> LabelKey:
        """The sample key for these label values (each made a string), in the declared order.

        Raises ValueError naming the family when the labels are not exactly the declared ones."""
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name}: labels {sorted(labels)} given, {list(self.labels)} declared")
        return self.name, tuple((name, str(labels[name])) for name in self.labels)

    def problems(self) -> list[str]:
        """What breaks the Prometheus naming conventions (empty: none)."""
        out = []
        if not _NAME.match(self.name):
            out.append("the name must be sentinel_ then lower-case words joined by _")
        if self.kind not in (COUNTER, GAUGE):
            out.append(f"kind must be {COUNTER!r} or {GAUGE!r}")
        if self.name.endswith("_total"):
            out.append("declare the name without _total: a counter's exposed name adds it (and a gauge must not end with it)")
        if any(self.name.endswith(u) or f"{u}_" in self.name for u in _NOT_BASE_UNITS):
            out.append("use base units (_seconds, _bytes, _celsius, _watts, ratios 0..1)")
        if self.kind == COUNTER and self.name.endswith("_info"):
            out.append("an _info metric is a gauge with value 1")
        if not self.help or self.help != self.help.strip() or "\n" in self.help:
            out.append("help must be one non-empty line")
        for label in self.labels:
            if not _LABEL.match(label) or label.startswith("__"):
                out.append(f"label {label!r} must be lower-case snake_case")
        if len(set(self.labels)) != len(self.labels):
            out.append("a label is declared twice")
        return out


def counter(name: str, help: str, *labels: str) -> Family:  # noqa: A002 - Prometheus' word
    return Family(name, COUNTER, help, labels)


def gauge(name: str, help: str, *labels: str) -> Family:  # noqa: A002 - Prometheus' word
    return Family(name, GAUGE, help, labels)
