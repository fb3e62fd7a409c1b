"""``retired_dbe``: many double-bit retired pages, one of them new this week."""

from __future__ import annotations

from sentinel.rules.base import ConfigKey, Finding, GpuRule

WEEK = 7 * 24 * 3600.0
RETIRED_DBE_LIMIT = ConfigKey(
    "retired_dbe_limit", 15,
    "DCGM's DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT 15 and its 'new DBE retirement in the last week' health check",
    0, 1_000_000)


class RetiredDbe(GpuRule):
    """Pages retired for double-bit errors > ``retired_dbe_limit`` (15) with a new one in the last
    7 days → ``migrate``. Old retirements alone do not trip: the GPU has lived with them.

    Memory: the times of new double-bit retirements in the last week.
    Source: DCGM's ``DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT`` and its weekly DBE health check."""

    name = "retired_dbe"
    fields = ("retired_pages_dbe",)
    counters = ("retired_pages_dbe",)
    config = (RETIRED_DBE_LIMIT,)
    order = 320

    def evaluate(self, ctx, cfg):
        times = tuple(t for t in ctx.memory.get(self.name, ()) if ctx.now - t < WEEK)
        if ctx.increase("retired_pages_dbe") > 0:
            times += (ctx.now,)
        ctx.memory[self.name] = times
        dbe = ctx.values.get("retired_pages_dbe", 0)
        if dbe <= cfg.retired_dbe_limit or not times:
            return ()
        return (Finding("migrate", self.name,
                        f"{dbe:g} double-bit retired pages > {cfg.retired_dbe_limit} with a new one this week",
                        {"retired_pages_dbe": dbe}),)


RULE = RetiredDbe()
