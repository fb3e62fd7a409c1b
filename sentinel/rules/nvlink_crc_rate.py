"""``nvlink_crc_rate``: NVLink CRC errors at a rate that matters."""

from __future__ import annotations

from sentinel.rules.base import DEBOUNCE_SAMPLES, ConfigKey, Finding, GpuRule

NVLINK_CRC_PER_SECOND_LIMIT = ConfigKey(
    "nvlink_crc_per_second_limit", 100.0,
    "DCGM_LIMIT_MAX_NVLINK_CRC_ERROR 100.0 ('CRC errors only matter at rates of 100+ per second')", 0, 1e12, low_open=True)


class NvlinkCrcRate(GpuRule):
    """CRC flit + data errors summed over the GPU's NVLinks ≥ ``nvlink_crc_per_second_limit``
    (100/s) on ``debounce_samples`` (3) polls in a row → ``migrate``.

    Source: DCGM's ``DCGM_LIMIT_MAX_NVLINK_CRC_ERROR``."""

    name = "nvlink_crc_rate"
    fields = ("nvlink",)
    config = (NVLINK_CRC_PER_SECOND_LIMIT, DEBOUNCE_SAMPLES)
    order = 410

    def evaluate(self, ctx, cfg):
        links = ctx.reading.nvlink
        if not links:
            return ()
        sums = ctx.reading.nvlink_sums
        crc = float(sums.get("crc_flit", 0) + sums.get("crc_data", 0))  # the CRC kinds of NVLINK_KINDS
        hist = ctx.short.get("nvlink_crc", ())
        ctx.short["nvlink_crc"] = (hist + ((ctx.now, crc),))[-2:]
        rate = None
        if hist and ctx.now > hist[-1][0] and crc >= hist[-1][1]:  # a counter reset gives no rate
            rate = (crc - hist[-1][1]) / (ctx.now - hist[-1][0])
        limit = cfg.nvlink_crc_per_second_limit
        if not ctx.sustained(self.name, rate is not None and rate >= limit, cfg.debounce_samples):
            return ()
        return (Finding("migrate", self.name,
                        f"NVLink CRC errors {rate:.0f}/s >= {limit:g}/s for {cfg.debounce_samples} polls",
                        {"per_second": rate or 0.0}),)


RULE = NvlinkCrcRate()
