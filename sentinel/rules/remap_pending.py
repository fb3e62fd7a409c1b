"""``remap_pending``: a row remap waits for a GPU reset."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class RemapPending(GpuRule):
    """A row remap is pending → ``migrate``: the faulty row stays in use until the GPU is reset.

    Source: NVIDIA row remapping doc — a remap takes effect only after a GPU reset."""

    name = "remap_pending"
    fields = ("remapped_rows_pending",)
    order = 350

    def evaluate(self, ctx, cfg):
        if ctx.values.get("remapped_rows_pending", 0) <= 0:
            return ()
        return (Finding("migrate", self.name, "a row remap is pending a GPU reset"),)


RULE = RemapPending()
