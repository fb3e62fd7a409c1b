"""The Grafana dashboard, generated: ``python -m sentinel_tools.dashboard`` writes
monitoring/grafana-dashboard.json with Grafana's own grafana-foundation-sdk (pinned in the
``dashboards`` extra), and ``--check`` exits 1 when the file differs from what this code makes
(tests/test_monitoring.py runs it: the JSON is never edited by hand).

Every query names its metric through the family constant that declares it
(:mod:`sentinel.families`), never as a string typed here: a renamed metric renames the query, a
removed one fails this import. tests/test_dashboard.py runs every panel's query against a real
Prometheus scraping a drill's daemons and asserts each returns series.

What the daemon does not export has no panel: the trainer's snapshot tiers (memory, peer
replica, disk) are reported by the drill and the benchmarks, not as metrics (docs/known-limits.md).
Counters are shown as totals since each daemon started, not as increase() over a window: a
counter's series appears with its first event (an Xid code, an action), and increase() reads
that first increment as 0. Conditions that a drill cannot show with data (loop errors, lost eBPF events, a blind node) are
alert rules (monitoring/alerts.yml), not panels that would stay empty.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from sentinel.actions import ACTIONS
from sentinel.daemon import LAST_POLL
from sentinel.exporter import RENDER_DURATION
from sentinel.families import Family
from sentinel.fields import NVML_FIELDS
from sentinel.fields import families as field_families
from sentinel.metrics import (GPU_HEALTH, GPU_PREDICTED_FAILURE, GPU_XID_ERRORS, POLICY_TRIPS,
                              SOURCE_POLL_DURATION, SOURCE_UP)
from sentinel.migration_record import MIGRATION_STEPS, NODE_CORDONED

OUT = Path(__file__).resolve().parents[1] / "monitoring" / "grafana-dashboard.json"
UID = "sentinel-overview"
TITLE = "Sentinel — GPU health, prediction and migration"


def _field(name: str) -> Family:
    """An NVML field's family (declared in sentinel.fields), by its declared name."""
    (family,) = [f for f in field_families(NVML_FIELDS) if f.name == name]
    return family


ECC = _field("sentinel_gpu_ecc_errors")
RETIRED = _field("sentinel_gpu_retired_pages")
REMAPPED = _field("sentinel_gpu_remapped_rows")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    kind: str  # stat, timeseries, bargauge, table
    title: str
    queries: tuple[Query, ...]
    width: int
    height: int
    unit: str = ""
    description: str = ""


def n(family: Family) -> str:
    return family.exposed


ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Node health", (
        PanelSpec("stat", "GPUs not healthy (by state)", tuple(
            Query(f"count({n(GPU_HEALTH)} == {v}) or vector(0)", legend) for v, legend in
            ((1, "watch"), (2, "predicted"), (3, "failed"))), 6, 4),
        PanelSpec("stat", "Nodes cordoned", (Query(f"sum({n(NODE_CORDONED)})"),), 6, 4),
        PanelSpec("timeseries", "GPU health (0 ok · 1 watch · 2 predicted · 3 failed)",
                  (Query(f"{n(GPU_HEALTH)} > 0", "{{instance}} gpu {{gpu}}"),), 12, 8),
        PanelSpec("table", "Xid errors by Xid (since each daemon started)",
                  (Query(f"sum by (instance, gpu, xid) ({n(GPU_XID_ERRORS)})"),), 12, 8),
        PanelSpec("table", "Signal coverage (0: the node is blind to it)",
                  (Query(f"min by (instance, source, via) ({n(SOURCE_UP)})"),), 12, 8,
                  description="One row per signal and the path that reads it (ebpf, kmsg, sysfs, nvml); "
                              "via=none and 0 when every path failed (alert SentinelSourceDown)."),
    )),
    ("Predictions and their lead time", (
        PanelSpec("timeseries", "Forecast time to failure threshold (lead time)",
                  (Query(n(GPU_PREDICTED_FAILURE), "{{instance}} gpu {{gpu}}"),), 12, 8, unit="s"),
        PanelSpec("bargauge", "Policy trips (since each daemon started)",
                  (Query(f"sum by (rule, action) ({n(POLICY_TRIPS)})", "{{rule}} → {{action}}"),), 12, 8),
        PanelSpec("timeseries", "Corrected ECC error rate",
                  (Query(f'rate({n(ECC)}{{type="corrected",scope="volatile"}}[5m])', "{{instance}} gpu {{gpu}}"),),
                  12, 8, unit="cps"),
        PanelSpec("timeseries", "Uncorrectable ECC errors (volatile)",
                  (Query(f'{n(ECC)}{{type="uncorrected",scope="volatile"}}', "{{instance}} gpu {{gpu}}"),), 12, 8),
        PanelSpec("timeseries", "Retired pages and remapped rows",
                  (Query(f'{n(RETIRED)} or {n(REMAPPED)}{{kind="uncorrectable"}}', "{{instance}} gpu {{gpu}} {{cause}}"),),
                  12, 8),
    )),
    ("Migrations and their stages", (
        PanelSpec("bargauge", "Migration steps (since each daemon started)",
                  (Query(f"sum by (step) ({n(MIGRATION_STEPS)})", "{{step}}"),), 12, 8,
                  description="started, agent_stopped, returned_to_service ... and each failure by name"),
        PanelSpec("table", "Actions by kind and outcome (since each daemon started)",
                  (Query(f"sum by (instance, action, outcome) ({n(ACTIONS)})"),), 12, 8,
                  description="notify, migrate, cordon ... and whether each was carried out"),
    )),
    ("Daemon cost", (
        PanelSpec("timeseries", "Source poll duration", (Query(n(SOURCE_POLL_DURATION), "{{instance}} {{source}}"),),
                  8, 8, unit="s"),
        PanelSpec("timeseries", "Scrape render duration", (Query(n(RENDER_DURATION), "{{instance}}"),), 8, 8, unit="s"),
        PanelSpec("timeseries", "Seconds since the last completed poll",
                  (Query(f"time() - {n(LAST_POLL)}", "{{instance}}"),), 8, 8, unit="s"),
    )),
)


def panels() -> list[PanelSpec]:
    return [p for _, row in ROWS for p in row]


def build() -> dict:
    """The dashboard as Grafana's JSON model, built with the SDK's builders."""
    from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    kinds = {"stat": stat.Panel, "timeseries": timeseries.Panel, "bargauge": bargauge.Panel, "table": table.Panel}
    ds = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (dashboard.Dashboard(TITLE).uid(UID).tags(["sentinel", "gpu"]).refresh("30s").time("now-24h", "now")
             .editable().with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")))
    ids = iter(range(1, 1000))
    for row_title, specs in ROWS:
        board = board.with_row(dashboard.Row(row_title).id(next(ids)))
        for spec in specs:
            panel = (kinds[spec.kind]().id(next(ids)).title(spec.title).datasource(ds).span(spec.width)
                     .height(spec.height))
            if spec.unit:
                panel = panel.unit(spec.unit)
            if spec.description:
                panel = panel.description(spec.description)
            for i, q in enumerate(spec.queries):
                target = prometheus.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i))
                if q.legend:
                    target = target.legend_format(q.legend)
                panel = panel.with_target(target)
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help=f"exit 1 when {OUT.name} differs from what this code makes")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is not what sentinel_tools/dashboard.py makes: run python -m sentinel_tools.dashboard",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(panels())} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
