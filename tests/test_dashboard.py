"""Every panel of the generated dashboard (monitoring/grafana-dashboard.json, made by
sentinel_tools/dashboard.py) answers with data from live daemons: a real drill (`sentinel drill
--fault sbe-ramp`: simulated GPUs under a torchrun job, a failure the trend predictor forecasts, a
snapshot and a migration to the spare) runs while Debian's Prometheus scrapes each of its daemons,
and each panel's query is run against that Prometheus until it returns series."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import REPO
from prom_server import Prometheus

pytestmark = [pytest.mark.needs_prometheus, pytest.mark.needs_torch, pytest.mark.slow]


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads((REPO / "monitoring" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def test_every_panel_query_returns_series_from_a_drill(tmp_path):
    import shutil

    from sentinel.sources import simulated

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    pytest.importorskip("torch")
    work, targets = tmp_path / "drill", tmp_path / "targets.json"
    targets.write_text("[]")
    prom = Prometheus(tmp_path / "prom", targets)
    # the drill's default length: a longer job on a loaded host also trips the straggler rule on the
    # survivor (a second migration with no spare left), which is another drill
    with open(tmp_path / "drill.log", "w") as log:
        drill = subprocess.Popen([sys.executable, "-m", "sentinel", "drill", "--fault", "sbe-ramp",
                                  "--workdir", str(work), "--keep", "--timeout", "300"], stdout=log,
                                 stderr=subprocess.STDOUT, cwd=REPO)
    queries = panel_queries()
    answered: dict[tuple[str, str], list] = {}
    scraped: list[str] = []
    xid_sent = False
    try:
        end = time.monotonic() + 400
        while drill.poll() is None and time.monotonic() < end and len(answered) < len(queries):
            ports = sorted(f"127.0.0.1:{json.loads(s.read_text())['metrics_port']}"
                           for s in work.glob("*/run/status.json") if s.stat().st_size)
            if ports != scraped:
                targets.write_text(json.dumps([{"targets": ports}]))
                scraped = ports
            # an application Xid on the node that is not failing (the fault is node1's; an alert, no
            # migration): the Xid panel's data. Only once node0's own daemon publishes: an Xid already
            # in the simulated state when the daemon first reads it is its baseline, not a new event
            status0 = work / "node0" / "run" / "status.json"
            if not xid_sent and status0.exists() and status0.stat().st_size:
                simulated.inject(work / "node0" / "gpus.json", 1, ["xid=13"])
                xid_sent = True
            for q in queries:
                if q not in answered:
                    res = prom.query(q[1])
                    if res:
                        answered[q] = res
            time.sleep(0.5)
    finally:
        if drill.poll() is None:
            drill.terminate()
        drill.wait(timeout=120)
        prom.stop()
    log_tail = (tmp_path / "drill.log").read_text()[-3000:]
    missing = [f"{title}: {expr}" for title, expr in queries if (title, expr) not in answered]
    assert not missing, "panels whose query returned no series from the drill's daemons:\n" + "\n".join(missing) \
        + f"\n--- drill\n{log_tail}"
    assert xid_sent and len(scraped) >= 3, (scraped, log_tail)
