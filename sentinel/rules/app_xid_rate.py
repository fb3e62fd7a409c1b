"""``app_xid_rate``: application Xids repeating past a rate."""

from __future__ import annotations

from sentinel.rules.base import Finding, GpuRule
from sentinel.rules.xid import APP_XID_MAX_PER_HOUR, XID_OVERRIDES


class AppXidRate(GpuRule):
    """Application Xids (13, 31, 43, 45, without an override) on this GPU more than
    ``app_xid_max_per_hour`` (30) times in the last hour → ``migrate``. Below that each is an
    ``xid`` alert: one bad kernel is the job's bug, a GPU that keeps faulting is not.

    Source: the Xid catalog lists them as application errors ("RESTART_APP"); 30/h is Sentinel's
    conservative default."""

    name = "app_xid_rate"
    config = (APP_XID_MAX_PER_HOUR, XID_OVERRIDES)
    order = 210

    def evaluate(self, ctx, cfg):
        limit = cfg.app_xid_max_per_hour
        worst: dict[int, int] = {}  # one finding per Xid and poll, with the count the last one reached
        for v in ctx.xids:  # (a storm brings thousands a poll: one finding, not one each)
            if v.per_hour is not None and v.per_hour > limit:
                worst[v.event.xid] = max(worst.get(v.event.xid, 0), v.per_hour)
        return [Finding("migrate", f"{self.name}:{xid}",
                        f"application Xid {xid} repeated {n} times or more in an hour (limit {limit})",
                        {"xid": xid, "per_hour": n})
                for xid, n in worst.items()]


RULE = AppXidRate()
