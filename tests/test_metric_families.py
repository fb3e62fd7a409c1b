"""Every exported metric family is declared once (next to the code that counts it), follows the
Prometheus naming conventions, and is documented in docs/metrics.md. The failure messages say
what to add: other engineers add metrics in parallel, and this is where they find out how.

How to declare a family: docs/metrics.md, "Declaring a metric".
"""

from __future__ import annotations

import ast
import logging
import re
from collections import defaultdict
from pathlib import Path

from prometheus_client.exposition import generate_latest

from sentinel.families import counter, gauge
from sentinel.metrics import View, build_registry
from sentinel_tools import metrics_doc

ROOT = Path(__file__).resolve().parents[1]
HOWTO = "see docs/metrics.md, 'Declaring a metric'"


def test_every_family_follows_the_prometheus_naming_conventions():
    bad = [f"  {d.family.exposed} ({d.where}): {problem}" for d in metrics_doc.declarations() for problem in d.family.problems()]
    assert not bad, "metric families that break the Prometheus naming conventions:\n" + "\n".join(bad)


def test_every_family_is_declared_once():
    where = defaultdict(list)
    for d in metrics_doc.declarations():
        where[d.family.name].append(d.where)
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, ("metric families declared more than once; keep the declaration in the module that counts it and "
                       "import it elsewhere:\n" + "\n".join(f"  {n}: {', '.join(p)}" for n, p in sorted(twice.items())))


def test_docs_metrics_md_lists_every_declared_family():
    decls = metrics_doc.declarations()
    doc = metrics_doc.DOC.read_text()
    documented = set(re.findall(r"^\| `(sentinel_\w+)` \|", doc, re.M))
    missing = sorted(d.family.exposed for d in decls if d.family.exposed not in documented)
    stale = sorted(documented - {d.family.exposed for d in decls})
    assert doc == metrics_doc.with_table(doc, decls), (
        "docs/metrics.md's table of families is out of date; run `python -m sentinel_tools.metrics_doc --write` "
        f"and commit docs/metrics.md.\n  not documented yet: {missing or 'none'}\n  documented but no longer declared: "
        f"{stale or 'none'}")


def test_every_family_in_the_golden_scrapes_is_declared():
    declared = {d.family.exposed: d.family for d in metrics_doc.declarations()}
    for name in ("metrics-fleet.txt", "metrics-full.txt"):
        text = (ROOT / "tests" / "golden" / name).read_text()
        for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
            exposed = family + "_total" if kind == "counter" and not family.endswith("_total") else family
            assert exposed in declared, f"{family} is served (tests/golden/{name}) but declared nowhere; {HOWTO}"
            assert declared[exposed].kind == kind, f"{family}: served as a {kind}, declared a {declared[exposed].kind}"


def _metric_key_literals(path: Path) -> list[int]:
    """Lines where a sample key is spelled ``("sentinel_...", (...))`` instead of ``FAMILY.key(...)``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2:
            first, second = node.elts
            if (isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("sentinel_")
                    and isinstance(second, (ast.Tuple, ast.Name, ast.Call, ast.Starred))):
                lines.append(node.lineno)
    return lines


def test_no_sample_key_bypasses_a_declaration():
    found = [f"  {path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "sentinel").rglob("*.py"))
             for line in _metric_key_literals(path)]
    assert not found, ("sample keys spelled as (\"sentinel_...\", labels) tuples: declare the family with "
                       "sentinel.families.counter/gauge in the module that counts it, list it in the component's "
                       f"FAMILIES and make the key with FAMILY.key(...) ({HOWTO}):\n" + "\n".join(found))


def test_the_key_checker_finds_a_literal_key(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('counts = {}\ncounts[("sentinel_widgets", (("reason", "x"),))] = 1\n')
    assert _metric_key_literals(src) == [2]


def test_a_key_must_carry_exactly_the_declared_labels():
    fam = counter("sentinel_widgets", "Widgets", "kind", "reason")
    assert fam.key(reason="r", kind=3) == ("sentinel_widgets", (("kind", "3"), ("reason", "r")))
    for bad in ({"kind": "k"}, {"kind": "k", "reason": "r", "extra": "e"}):
        try:
            fam.key(**bad)
        except ValueError as exc:
            assert "sentinel_widgets" in str(exc) and "declared" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


def test_naming_problems_are_named():
    assert counter("sentinel_widgets", "Widgets made").problems() == []
    assert gauge("sentinel_widget_info", "Widget identity", "model").problems() == []
    assert any("_total" in p for p in counter("sentinel_widgets_total", "Widgets").problems())
    assert any("base units" in p for p in gauge("sentinel_widget_latency_milliseconds", "Latency").problems())
    assert any("help" in p for p in gauge("sentinel_widgets", "").problems())
    assert any("label" in p for p in gauge("sentinel_widgets", "W", "Kind").problems())


def test_an_undeclared_sample_is_left_out_logged_and_counted(caplog):
    """The daemon never makes up a help text: a name no family declares is not exported."""
    declared = counter("sentinel_widgets", "Widgets made", "kind")
    view = View(counters={declared.key(kind="a"): 2.0, ("sentinel_mystery", (("kind", "b"),)): 5.0,
                          ("sentinel_widgets", (("other", "c"),)): 1.0})
    registry = build_registry(lambda: view, [declared])
    with caplog.at_level(logging.ERROR, logger="sentinel.metrics"):
        text = generate_latest(registry).decode()
    assert '# HELP sentinel_widgets_total Widgets made\nsentinel_widgets_total{kind="a"} 2.0' in text.replace(
        "# TYPE sentinel_widgets_total counter\n", "")
    assert "sentinel_mystery" not in text.replace('name="sentinel_mystery"', "")
    assert 'sentinel_exporter_undeclared_samples_total{name="sentinel_mystery"} 1.0' in text
    assert 'sentinel_exporter_undeclared_samples_total{name="sentinel_widgets"} 1.0' in text
    assert "sentinel_mystery not exported: no metric family declares it" in caplog.text
    assert "labels ['other'] are not the declared ['kind']" in caplog.text


def test_a_family_declared_twice_differently_is_refused():
    try:
        build_registry(lambda: View(), [counter("sentinel_widgets", "A"), gauge("sentinel_widgets", "B")])
    except ValueError as exc:
        assert "sentinel_widgets" in str(exc)
    else:
        raise AssertionError("accepted")
