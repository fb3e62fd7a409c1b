"""Alert rules through promtool (check + unit tests) and a dashboard whose queries name real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from conftest import REPO

MON = REPO / "monitoring"


@pytest.mark.needs_prometheus
def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "rules", str(MON / "alerts.yml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"SUCCESS: {len(alert_rules())} rules found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], capture_output=True, text=True, timeout=60, cwd=MON)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_dashboard_queries_name_declared_metrics():
    """Every metric a panel queries is a declared family (tests/test_dashboard.py checks that each
    query returns series from a drill's live daemons)."""
    from sentinel_tools import metrics_doc

    declared = {d.family.exposed for d in metrics_doc.declarations()}
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    names = [(panel["title"], name) for panel in dash["panels"] for target in panel.get("targets", [])  # rows have none
             for name in re.findall(r"\b(sentinel_[a-z_]+)", target["expr"])]
    assert names
    for title, name in names:
        assert name in declared, f"panel {title!r} queries {name}, which no metric family declares"


def alert_rules() -> list[dict]:
    import yaml

    return [r for g in yaml.safe_load((MON / "alerts.yml").read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_runbook_section_in_the_docs():
    """runbook_url -> docs/runbooks.md#<anchor>, and the anchor is a heading there (GitHub's slug)."""
    base = "https://github.com/sentinel-gpu/sentinel/blob/main/docs/runbooks.md#"
    headings = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#{1,6} (.+)$", (REPO / "docs" / "runbooks.md").read_text(), re.M)}
    rules = alert_rules()
    assert len(rules) >= 13
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(base), f"{rule['alert']}: runbook_url {url!r} does not point into docs/runbooks.md"
        assert url[len(base):] in headings, f"{rule['alert']}: docs/runbooks.md has no section #{url[len(base):]}"


def test_the_issue_s_alerts_exist_and_daemon_down_matches_the_podmonitor_job():
    import yaml

    by_name = {r["alert"]: r for r in alert_rules()}
    assert {"SentinelAgentMissing", "SentinelFailureWhileMigrating", "SentinelConfigReloadRejected",
            "SentinelLoopErrors"} <= set(by_name)
    podmonitor = yaml.safe_load((REPO / "deploy" / "kubernetes" / "components" / "podmonitor" / "podmonitor.yaml").read_text())
    assert podmonitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
    daemonset = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text())
    pod_labels = next(d for d in daemonset if d and d.get("kind") == "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    job = pod_labels[podmonitor["spec"]["jobLabel"]]
    expr = by_name["SentinelDaemonDown"]["expr"]
    matcher = re.search(r'job=~"([^"]+)"', expr).group(1)
    for produced in (job, f"{podmonitor['metadata']['namespace']}/{podmonitor['metadata']['name']}"):
        assert re.fullmatch(matcher, produced), f"{expr} misses job={produced!r}"


def test_the_state_panel_counts_each_state_not_the_metric_name():
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    panel = next(p for p in dash["panels"] if p["title"] == "GPUs not healthy (by state)")
    assert [(t["expr"], t["legendFormat"]) for t in panel["targets"]] == [
        ("count(sentinel_gpu_health == 1) or vector(0)", "watch"),
        ("count(sentinel_gpu_health == 2) or vector(0)", "predicted"),
        ("count(sentinel_gpu_health == 3) or vector(0)", "failed")]  # values checked by promql_expr_test
    assert not any("__name__" in t["expr"] for p in dash["panels"] for t in p.get("targets", []))


def test_the_dashboard_is_generated_never_edited_by_hand():
    """monitoring/grafana-dashboard.json is exactly what sentinel_tools/dashboard.py makes with
    grafana-foundation-sdk (`python -m sentinel_tools.dashboard` rewrites it)."""
    pytest.importorskip("grafana_foundation_sdk", reason="pip install 'sentinel-gpu[dashboards]'")
    from sentinel_tools import dashboard

    assert dashboard.main(["--check"]) == 0
    generated = json.loads(dashboard.render())
    assert generated["uid"] == "sentinel-overview"
    assert {p["type"] for p in generated["panels"]} >= {"row", "stat", "timeseries", "bargauge", "table"}
