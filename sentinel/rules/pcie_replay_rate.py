"""``pcie_replay_rate``: PCIe replays faster than the link's error budget."""

from __future__ import annotations

from sentinel.rules.base import DEBOUNCE_SAMPLES, ConfigKey, Finding, GpuRule

PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}  # line rate per lane, GT/s
PCIE_REPLAY_BER = ConfigKey(
    "pcie_replay_ber", 1e-12,
    "the issue's DCGM-derived formula (PCIe spec BER 1e-12); DCGM's own header fixes 8/min "
    "(DCGM_LIMIT_MAX_PCIREPLAY_RATE): set pcie_replay_ber to match yours", 0, 1, low_open=True)


class PcieReplayRate(GpuRule):
    """PCIe replays per minute over the last 60 s > ``pcie_replay_ber`` × line rate × lanes × 60
    (Gen5 x16: 30.7/min) on ``debounce_samples`` (3) polls in a row → ``snapshot``.

    Source: the issue's DCGM-derived formula; DCGM's header fixes 8/min instead."""

    name = "pcie_replay_rate"
    fields = ("pcie_replay", "pcie_link_gen", "pcie_link_width")
    counters = ("pcie_replay",)
    config = (PCIE_REPLAY_BER, DEBOUNCE_SAMPLES)
    order = 400

    def evaluate(self, ctx, cfg):
        v = ctx.values
        rate = ctx.window_rate("pcie_replay", v.get("pcie_replay"))  # keeps the window even when gen/width fail
        if rate is None or "pcie_link_gen" not in v or "pcie_link_width" not in v:
            return ()
        gts = PCIE_GTS.get(int(v["pcie_link_gen"]), 32.0)
        limit_per_min = cfg.pcie_replay_ber * gts * 1e9 * v["pcie_link_width"] * 60.0
        per_min = rate * 60.0
        if not ctx.sustained(self.name, per_min > limit_per_min, cfg.debounce_samples):
            return ()
        return (Finding("snapshot", self.name, f"PCIe replays {per_min:.1f}/min > {limit_per_min:.1f}/min",
                        {"per_minute": per_min, "limit": limit_per_min}),)


RULE = PcieReplayRate()
