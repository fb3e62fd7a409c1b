"""``nvml_hung``: NVML calls on a GPU keep passing their deadline."""

from __future__ import annotations

from sentinel.rules.base import DEBOUNCE_SAMPLES, Finding, GpuRule


class NvmlHung(GpuRule):
    """An NVML call on this GPU passed its deadline on ``debounce_samples`` (3) polls in a row →
    ``migrate``; a single hung poll only puts the GPU in WATCH.

    Source: Sentinel — a wedged driver is the usual prelude to Xid 79."""

    name = "nvml_hung"
    config = (DEBOUNCE_SAMPLES,)
    order = 110

    def evaluate(self, ctx, cfg):
        hung = ctx.reading.hung
        if ctx.sustained(self.name, hung, cfg.debounce_samples):
            return (Finding("migrate", self.name, f"NVML calls on GPU {ctx.gpu} hung for {cfg.debounce_samples} polls"),)
        if hung:
            ctx.watch(self.name)
        return ()


RULE = NvmlHung()
