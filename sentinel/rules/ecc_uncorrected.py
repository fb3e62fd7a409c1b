"""``ecc_uncorrected``: uncorrectable ECC errors since the last GPU reset."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class EccUncorrected(GpuRule):
    """The volatile uncorrectable ECC counter grew since the last poll, or is above 0 at its first
    reading (daemon start, ``sentinel scan``, the first poll after a counter reset) → ``migrate``.

    The volatile counter is cleared only by a GPU reset or a driver reload, so a value above 0 is a
    state, not only an event: a double-bit error the GPU has carried since before Sentinel looked
    still needs the reset. A GPU is judged by what it holds, not only by what changes.

    Source: NVIDIA GPU memory error management guide — a double-bit error corrupts data and
    requires a GPU reset; NVML ``nvmlDeviceGetTotalEccErrors(VOLATILE)`` counts since the last one."""

    name = "ecc_uncorrected"
    fields = ("ecc_uncorrected_volatile",)
    counters = ("ecc_uncorrected_volatile",)
    order = 300

    def evaluate(self, ctx, cfg):
        value = ctx.values.get("ecc_uncorrected_volatile")
        if value is None:
            return ()
        if "ecc_uncorrected_volatile" not in ctx.previous:  # first reading: what the GPU holds now
            if value <= 0:
                return ()
            return (Finding("migrate", self.name, f"{value:g} uncorrectable ECC error(s) since the last GPU reset "
                            "(present at the first reading)", {"ecc_uncorrected_volatile": value}),)
        new = ctx.increase("ecc_uncorrected_volatile")
        if new <= 0:
            return ()
        return (Finding("migrate", self.name, f"{new:g} new uncorrectable ECC error(s)",
                        {"ecc_uncorrected_volatile": value}),)


RULE = EccUncorrected()
