"""``retired_pages``: too many retired pages."""

from __future__ import annotations

from sentinel.rules.base import ConfigKey, Finding, GpuRule

RETIRED_PAGES_LIMIT = ConfigKey(
    "retired_pages_limit", 63,
    "the issue's DCGM limit; DCGM's dcgm_gpu_hardware_limits.h has DCGM_LIMIT_MAX_RETIRED_PAGES 60 and NVIDIA's "
    "page-retirement doc caps retirement at 64 pages: 63 is one before the hard cap",
    1, 1_000_000)  # a limit of 0 on a ">=" rule would fail every healthy GPU


class RetiredPages(GpuRule):
    """Retired pages (single-bit + double-bit) ≥ ``retired_pages_limit`` (63) → ``migrate``.

    Source: DCGM's ``DCGM_LIMIT_MAX_RETIRED_PAGES`` (60) and the 64-page retirement cap in NVIDIA's
    dynamic page retirement doc."""

    name = "retired_pages"
    fields = ("retired_pages_sbe", "retired_pages_dbe")
    config = (RETIRED_PAGES_LIMIT,)
    order = 310

    def evaluate(self, ctx, cfg):
        v = ctx.values
        if "retired_pages_sbe" not in v or "retired_pages_dbe" not in v:
            return ()
        total = v["retired_pages_sbe"] + v["retired_pages_dbe"]
        if total < cfg.retired_pages_limit:
            return ()
        return (Finding("migrate", self.name, f"{total:g} retired pages >= limit {cfg.retired_pages_limit}",
                        {"retired_pages": total}),)


RULE = RetiredPages()
