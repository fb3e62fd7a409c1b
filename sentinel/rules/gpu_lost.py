"""``gpu_lost``: NVML says the GPU is lost."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule


class GpuLost(GpuRule):
    """NVML returns ``NVML_ERROR_GPU_IS_LOST`` for this GPU: it fell off the bus → ``migrate``.

    Source: NVML (the device is gone until a reset or reboot; usually with Xid 79)."""

    name = "gpu_lost"
    order = 100

    def evaluate(self, ctx, cfg):
        if not ctx.reading.lost:
            return ()
        return (Finding("migrate", self.name, f"GPU {ctx.gpu} is lost (fell off the bus)"),)


RULE = GpuLost()
