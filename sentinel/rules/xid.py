"""``xid``: Xid events, by the NVIDIA Xid catalog's resolution buckets and the configured overrides.

The buckets live here; the policy turns them, ``xid_overrides`` and ``xid_skip`` into its lookup
table once (``action_table``) and hands the rules one verdict per accepted event."""

from __future__ import annotations

from typing import Mapping

from sentinel import settings
from sentinel.rules.base import ConfigKey, Finding, GpuRule

# NVIDIA Xid catalog resolution buckets (docs.nvidia.com/deploy/xid-errors).
XID_MIGRATE = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 140})
XID_SNAPSHOT = frozenset({63, 94})
XID_APPLICATION = frozenset({13, 31, 43, 45})

XID_ACTIONS = ("migrate", "snapshot", "alert", "ignore")
XID_MIN, XID_MAX = 1, 65535


def check_overrides(prefix: str, overrides: Mapping[str, str]) -> None:
    for key, action in overrides.items():
        where = f"{prefix}.xid_overrides.{settings.printable(key)}"
        # str.isdigit() accepts "²" and "٣", which int() then rejects or misreads: ASCII only,
        # and one spelling per Xid ("079" would silently duplicate "79").
        if not (key.isascii() and key.isdigit() and key == str(int(key)) and XID_MIN <= int(key) <= XID_MAX):
            raise settings.ConfigError(f"{where}: Xid keys are numbers {XID_MIN}..{XID_MAX} in plain ASCII digits, e.g. \"79\"")
        if action not in XID_ACTIONS:
            raise settings.ConfigError(f"{where}: action must be migrate, snapshot, alert or ignore (got {action!r})")


def check_skip(prefix: str, skip: tuple[int, ...]) -> None:
    for i, xid in enumerate(skip):
        settings.integer(prefix, f"xid_skip[{i}]", xid, XID_MIN, XID_MAX)


XID_OVERRIDES = ConfigKey("xid_overrides", {}, "operator: Xid number -> migrate | snapshot | alert | ignore",
                          check=check_overrides, type=Mapping[str, str])
XID_SKIP = ConfigKey("xid_skip", (), "operator: Xids never acted on", check=check_skip, type=tuple[int, ...])
APP_XID_MAX_PER_HOUR = ConfigKey(
    "app_xid_max_per_hour", 30,
    "Sentinel's conservative default; the Xid catalog lists 13, 31, 43, 45 as application errors (RESTART_APP)",
    0, 1_000_000)


def action_table(overrides: Mapping[str, str], skip: tuple[int, ...]) -> dict[int, str]:
    """Xid -> action from the catalog buckets, then ``xid_overrides``, then ``xid_skip`` ("ignore")."""
    table = {xid: "migrate" for xid in XID_MIGRATE}
    table.update({xid: "snapshot" for xid in XID_SNAPSHOT})
    table.update({int(key): action for key, action in overrides.items()})
    table.update({xid: "ignore" for xid in skip})
    return table


class Xid(GpuRule):
    """An Xid reported for this GPU (NVML events, the kernel log or eBPF; one report per Xid).

    * hardware-fatal bucket — 48 (DBE), 61/62 (micro-controller halt), 64 (remap/retirement
      recording failure), 74 (NVLink), 79 (fallen off the bus), 95 (uncontained ECC), 119/120 (GSP
      RPC timeout/error), 140 (unrecovered ECC) → ``migrate`` (catalog: RESET_GPU / RESTART_BM /
      CONTACT_SUPPORT);
    * contained — 63 (row-remap/page-retirement recorded), 94 (contained ECC) → ``snapshot``;
    * application Xids 13, 31, 43, 45 → ``alert`` while under ``app_xid_max_per_hour`` (past it,
      ``app_xid_rate`` trips instead);
    * 92 and any Xid not listed → ``alert``.

    ``xid_overrides`` sets any Xid's action (an override takes an application Xid out of the rate
    count); ``xid_skip`` ignores it. Source: the NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors)."""

    name = "xid"
    config = (XID_OVERRIDES, XID_SKIP, APP_XID_MAX_PER_HOUR)
    order = 200

    def evaluate(self, ctx, cfg):
        found = []
        for verdict in ctx.xids:
            xid = verdict.event.xid
            if verdict.per_hour is None:
                found.append(Finding(verdict.action or "alert", f"xid:{xid}",
                                     f"Xid {xid} on GPU {ctx.gpu} ({verdict.event.source})", {"xid": xid}))
            elif verdict.per_hour <= cfg.app_xid_max_per_hour:
                # one alert per poll: the cause carries the poll's time, so a later burst alerts again
                found.append(Finding("alert", f"xid:{xid}:{ctx.now}", f"application Xid {xid} on GPU {ctx.gpu}", {"xid": xid}))
        return found


RULE = Xid()
