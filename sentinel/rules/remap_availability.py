"""``remap_availability``: memory banks running out of spare rows."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class RemapAvailability(GpuRule):
    """The row-remapper histogram: a bank with no spare rows left → ``migrate``; else a bank with
    few left → ``snapshot``.

    Source: NVML ``nvmlDeviceGetRowRemapperHistogram``."""

    name = "remap_availability"
    fields = ("remap_histogram_low", "remap_histogram_none")
    order = 370

    def evaluate(self, ctx, cfg):
        none, low = ctx.values.get("remap_histogram_none", 0), ctx.values.get("remap_histogram_low", 0)
        if none > 0:
            return (Finding("migrate", f"{self.name}:none", f"{none:g} memory bank(s) have no remap rows left",
                            {"banks_none": none}),)
        if low > 0:
            return (Finding("snapshot", f"{self.name}:low", f"{low:g} memory bank(s) are low on remap rows",
                            {"banks_low": low}),)
        return ()


RULE = RemapAvailability()
