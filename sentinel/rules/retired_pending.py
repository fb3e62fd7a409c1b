"""``retired_pending``: a page retirement waits for a GPU reset."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class RetiredPending(GpuRule):
    """A page retirement is pending (it takes effect at the next GPU reset) → ``alert``.

    Source: NVML ``nvmlDeviceGetRetiredPagesPendingStatus``."""

    name = "retired_pending"
    fields = ("retired_pages_pending",)
    order = 330

    def evaluate(self, ctx, cfg):
        if ctx.values.get("retired_pages_pending", 0) <= 0:
            return ()
        return (Finding("alert", self.name, "a page retirement is pending a GPU reset"),)


RULE = RetiredPending()
