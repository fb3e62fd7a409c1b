"""``thermal``: the GPU at or above its own slowdown temperature."""

from __future__ import annotations

from sentinel.rules.base import DEBOUNCE_SAMPLES, Finding, GpuRule


class Thermal(GpuRule):
    """Temperature ≥ the GPU's own slowdown threshold (``NVML_TEMPERATURE_THRESHOLD_SLOWDOWN``) →
    ``alert`` at once, ``snapshot`` once it has held for ``debounce_samples`` (3) polls.

    Source: NVML (the threshold is the GPU's own, read from the device)."""

    name = "thermal"
    fields = ("temperature_celsius", "slowdown_temperature_celsius")
    config = (DEBOUNCE_SAMPLES,)
    order = 420

    def evaluate(self, ctx, cfg):
        v = ctx.values
        if "temperature_celsius" not in v or "slowdown_temperature_celsius" not in v:
            return ()
        temp, slowdown = v["temperature_celsius"], v["slowdown_temperature_celsius"]
        hot = temp >= slowdown
        if ctx.sustained(self.name, hot, cfg.debounce_samples):
            return (Finding("snapshot", self.name,
                            f"{temp:g} C >= slowdown {slowdown:g} C for {cfg.debounce_samples} polls",
                            {"temperature_celsius": temp}),)
        if hot:
            return (Finding("alert", f"{self.name}:hot", f"{temp:g} C >= slowdown threshold",
                            {"temperature_celsius": temp}),)
        return ()


RULE = Thermal()
