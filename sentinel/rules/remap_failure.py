"""``remap_failure``: row remapping failed."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class RemapFailure(GpuRule):
    """The row remapper reports a failure → ``migrate``.

    Source: NVIDIA A100/H100 row remapping doc — a remap failure calls for RMA evaluation."""

    name = "remap_failure"
    fields = ("remapped_rows_failure",)
    order = 340

    def evaluate(self, ctx, cfg):
        if ctx.values.get("remapped_rows_failure", 0) <= 0:
            return ()
        return (Finding("migrate", self.name, "row remapping failed"),)


RULE = RemapFailure()
