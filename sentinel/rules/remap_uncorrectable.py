"""``remap_uncorrectable``: too many rows remapped for uncorrectable errors."""

from __future__ import annotations

from sentinel.rules.base import ConfigKey, Finding, GpuRule

REMAP_UNCORRECTABLE_LIMIT = ConfigKey(
    "remap_uncorrectable_limit", 512, "the issue's limit (NVIDIA row remapping doc's RMA guidance)",
    1, 1_000_000)  # a limit of 0 on a ">=" rule would fail every healthy GPU


class RemapUncorrectable(GpuRule):
    """Rows remapped for uncorrectable errors ≥ ``remap_uncorrectable_limit`` (512) → ``migrate``.

    Source: the issue's limit, from the row remapping doc's RMA guidance."""

    name = "remap_uncorrectable"
    fields = ("remapped_rows_uncorrectable",)
    config = (REMAP_UNCORRECTABLE_LIMIT,)
    order = 360

    def evaluate(self, ctx, cfg):
        rows = ctx.values.get("remapped_rows_uncorrectable", 0)
        if rows < cfg.remap_uncorrectable_limit:
            return ()
        return (Finding("migrate", self.name, f"{rows:g} uncorrectable remaps >= {cfg.remap_uncorrectable_limit}",
                        {"remapped_rows_uncorrectable": rows}),)


RULE = RemapUncorrectable()
