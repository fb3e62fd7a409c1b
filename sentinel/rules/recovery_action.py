"""``recovery_action``: what the driver says the GPU needs (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule

# NVML_GPU_RECOVERY_ACTION_* (nvml.h, drivers >= 570; nvidia-ml-py 13) -> (name, Sentinel's action).
# A GPU that needs a reset or a reboot cannot keep the job's ranks: migrate. Draining P2P traffic
# stops the job's peer-to-peer transfers: snapshot while it still can. Unknown values: alert.
ACTIONS = {
    1: ("gpu reset", "migrate"),
    2: ("node reboot", "migrate"),
    3: ("drain p2p", "snapshot"),
    4: ("drain and reset", "migrate"),
    5: ("recover imex domain", "snapshot"),
    6: ("bus reset", "migrate"),
    7: ("system reboot", "migrate"),
}


class RecoveryAction(GpuRule):
    """The driver's recovery action for this GPU is not ``none``: GPU reset, node reboot, drain and
    reset (and bus/system reboot) → ``migrate``; drain P2P (and recover IMEX domain) → ``snapshot``;
    a value this table does not know → ``alert``. Read only where the driver supports the field
    (drivers >= 570); elsewhere the rule is inactive, as for every field.

    Source: NVML ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (field id 230) and its
    ``NVML_GPU_RECOVERY_ACTION_*`` values; NVIDIA's resiliency extension treats every value but
    NONE as unhealthy (nvidia-resiliency-ext ``GPUHealthCheck``)."""

    name = "recovery_action"
    fields = ("recovery_action",)
    order = 150

    def evaluate(self, ctx, cfg):
        value = ctx.values.get("recovery_action")
        if value is None or value == 0:
            return ()
        code = int(value)
        what, action = ACTIONS.get(code, (f"unknown action {code}", "alert"))
        return (Finding(action, f"{self.name}:{code}", f"GPU {ctx.gpu}: the driver asks for a {what} "
                        f"(NVML recovery action {code})", {"recovery_action": float(code)}),)


RULE = RecoveryAction()
