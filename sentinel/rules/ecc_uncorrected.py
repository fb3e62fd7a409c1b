"""``ecc_uncorrected``: a new uncorrectable ECC error."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class EccUncorrected(GpuRule):
    """The volatile uncorrectable ECC counter grew since the last poll → ``migrate``.

    Source: NVIDIA GPU memory error management guide — a double-bit error corrupts data and
    requires a GPU reset."""

    name = "ecc_uncorrected"
    fields = ("ecc_uncorrected_volatile",)
    counters = ("ecc_uncorrected_volatile",)
    order = 300

    def evaluate(self, ctx, cfg):
        new = ctx.increase("ecc_uncorrected_volatile")
        if new <= 0:
            return ()
        return (Finding("migrate", self.name, f"{new:g} new uncorrectable ECC error(s)",
                        {"ecc_uncorrected_volatile": ctx.values["ecc_uncorrected_volatile"]}),)


RULE = EccUncorrected()
