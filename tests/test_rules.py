"""The rule registry: every rule declares what it needs, reads only what it declares, is documented,
and is pure. A new module in sentinel/rules/ is held to all of this without being listed here."""

from __future__ import annotations

import dataclasses
import pkgutil
import random
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from sentinel import rules
from sentinel_tools import scenarios
from sentinel.config import PolicyConfig
from sentinel.policy import RULES, Policy, PolicyState
from sentinel.readings import FIELDS, GpuReading, KernelEvent, NodeReadings, XidEvent
from sentinel.rules.base import ACTIONS, GpuRule, NodeRule

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "docs" / "policy.md").read_text()
POLICY_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                   for f in dataclasses.fields(PolicyConfig)}
# PolicyConfig keys that the policy's shared machinery reads, not a rule.
POLICY_OWN_KEYS = {"cooldown_seconds", "disabled_rules"}
IDS = [r.name for r in rules.REGISTRY]


def test_every_module_in_the_package_is_a_registered_rule():
    modules = {m.name for m in pkgutil.iter_modules(rules.__path__)} - rules.NOT_RULES
    assert sorted(modules) == sorted(r.name for r in rules.REGISTRY)  # module named after its rule
    assert [r.order for r in rules.REGISTRY] == sorted({r.order for r in rules.REGISTRY})  # unique, in order
    assert dict(RULES) == {r.name: r.fields for r in rules.REGISTRY}


@pytest.mark.parametrize("rule", rules.REGISTRY, ids=IDS)
def test_rule_declares_name_docs_fields_and_config(rule):
    assert re.fullmatch(r"[a-z][a-z0-9_]*", rule.name)
    doc = type(rule).__doc__ or ""
    assert doc not in (GpuRule.__doc__, NodeRule.__doc__) and len(doc.split()) >= 10, "document the rule in its class docstring"
    assert "Source:" in doc, "say where the rule's condition or default comes from"
    assert any(f"``{a}``" in doc for a in ACTIONS), "name the action the rule takes"
    assert isinstance(rule, (GpuRule, NodeRule))
    assert set(rule.fields) <= set(FIELDS) | {"nvlink"}
    assert set(rule.counters) <= set(FIELDS)
    if isinstance(rule, NodeRule):
        assert rule.fields == () and rule.counters == ()
    for key in rule.config:
        assert key.name in POLICY_DEFAULTS, f"{rule.name}: {key.name} is not a PolicyConfig key"
        assert key.default == POLICY_DEFAULTS[key.name], f"{rule.name}: {key.name} default differs from PolicyConfig's"
        assert len(key.source.split()) >= 2, f"{rule.name}: give the source of {key.name}'s default"


def test_every_policy_key_is_declared_by_a_rule_or_the_policy():
    declared = {key.name for r in rules.REGISTRY for key in r.config}
    assert set(POLICY_DEFAULTS) - declared == POLICY_OWN_KEYS


@pytest.mark.parametrize("rule", rules.REGISTRY, ids=IDS)
def test_rule_has_a_row_in_the_docs_table(rule):
    assert re.search(rf"^\| `{rule.name}` ", DOCS, re.M), f"docs/policy.md: add a row for {rule.name}"


def test_the_rules_package_imports_neither_the_config_nor_the_policy():
    code = ("import sys, sentinel.rules; "
            "assert not {'sentinel.config', 'sentinel.policy'} & set(sys.modules), sorted(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


# -- what the rules read, on a long random poll sequence that trips every rule ---------------------
class RecordingConfig:
    """A PolicyConfig that remembers which attributes were read."""

    def __init__(self, cfg, reads):
        self._cfg, self._reads = cfg, reads

    def __getattr__(self, name):
        self._reads.add(name)
        return getattr(self._cfg, name)


def recording(rule, reads):
    """``rule`` with every evaluate's config reads added to ``reads``."""
    base = GpuRule if isinstance(rule, GpuRule) else NodeRule
    attrs = {a: getattr(rule, a) for a in ("name", "fields", "counters", "config", "order", "predicts")}
    attrs["evaluate"] = lambda self, subject, cfg: rule.evaluate(subject, RecordingConfig(cfg, reads))
    if getattr(rule, "rated", False):
        attrs.update(rated=True, rate_key=lambda self, event: rule.rate_key(event),
                     evaluate_rate=lambda self, event, cfg, history, now: rule.evaluate_rate(
                         event, RecordingConfig(cfg, reads), history, now))
    return type(f"Recorded{type(rule).__name__}", (base,), attrs)()


COUNTERS = ("ecc_uncorrected_volatile", "retired_pages_sbe", "retired_pages_dbe", "remapped_rows_uncorrectable",
            "pcie_replay")
FLAGS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure", "remap_histogram_low",
         "remap_histogram_none")


def random_polls(seed, n):
    """``n`` polls of two GPUs with climbing counters, flags, heat, NVLink CRC bursts, hangs, losses,
    Xids (application ones in storms) and kernel events of every kind."""
    rng = random.Random(seed)
    vals = [{k: float(v) for k, v in scenarios.HEALTHY.items() if k != "nvlink_crc"} for _ in range(2)]
    crc = [0, 0]
    t = 0.0
    for _ in range(n):
        t += rng.choice((1.0, 10.0, 60.0))
        gpus = []
        for i, v in enumerate(vals):
            for k in COUNTERS:
                v[k] += rng.choice((0, 0, 1, 3, 40))
            for k in FLAGS:
                if rng.random() < 0.05:
                    v[k] = float(rng.randint(0, 1))
            v["temperature_celsius"] = float(rng.choice((45, 45, 95)))
            v["recovery_action"] = float(rng.choice((0, 0, 0, 0, 2, 3)))
            crc[i] += rng.choice((0, 10_000))
            hung, lost = rng.random() < 0.15, rng.random() < 0.02
            gpus.append(GpuReading(index=i, uuid=f"GPU-{i}", pci_bus_id=f"0000:{i}:00.0", values={} if hung or lost else dict(v),
                                   nvlink={} if hung or lost else {(0, "crc_flit"): crc[i]}, hung=hung, lost=lost))
        xids = tuple(XidEvent(gpu=rng.randint(0, 1), xid=rng.choice((13, 13, 13, 79, 94, 92)), source="nvml")
                     for _ in range(rng.choice((0, 0, 2, 12))))
        kernel = tuple(rng.choice((
            KernelEvent("rank_signal", "t", {"signal": "SIGBUS", "code": rng.choice((0, 4)), "pid": 1, "comm": "p"}),
            KernelEvent("mc_error", "t", {"type": "uncorrected", "count": 1, "mc": 0}),
            KernelEvent("mc_error", "t", {"type": "corrected", "count": 12, "mc": 0}),
            KernelEvent("aer", "t", {"severity": "fatal", "device": "0000:0:00.0"}, gpu=0),
            KernelEvent("kernel_log", "t", {"kind": "gpu_fallen_off_bus", "severity": "critical", "action": "migrate",
                                            "message": "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus."}, gpu=1),
        )) for _ in range(rng.choice((0, 0, 0, 1))))
        yield t, NodeReadings(time=t, driver_version="t", gpus=tuple(gpus), xid_events=xids, kernel_events=kernel,
                              events_only=rng.random() < 0.1)


def test_rules_read_only_the_config_keys_they_declare_and_each_one_trips():
    cfg = dataclasses.replace(PolicyConfig(), cooldown_seconds=30.0, app_xid_max_per_hour=10, retired_dbe_limit=3,
                              trend_window_seconds=600.0)
    reads: dict[str, set[str]] = {r.name: set() for r in rules.REGISTRY}
    policy = Policy(cfg, rules=[recording(r, reads[r.name]) for r in rules.REGISTRY])
    state, tripped = PolicyState(), set()
    for t, readings in random_polls(seed=1, n=600):
        state, trips = policy.decide(state, readings, t)
        assert all(trip.action in ACTIONS for trip in trips)
        tripped |= {trip.rule for trip in trips}
    assert tripped == rules.RULE_NAMES  # so every rule's tripping branch ran under the recorder
    for rule in rules.REGISTRY:
        undeclared = reads[rule.name] - {key.name for key in rule.config}
        assert not undeclared, f"{rule.name} reads {sorted(undeclared)} without declaring them"


def test_rules_are_pure_no_clock_no_io(monkeypatch):
    """The same polls give the same trips, and evaluation never reads the clock or opens a file."""
    def forbidden(*_a, **_k):
        raise AssertionError("a rule read the clock or did I/O")

    def run():
        policy, state, out = Policy(PolicyConfig()), PolicyState(), []
        for t, readings in random_polls(seed=2, n=300):
            state, trips = policy.decide(state, readings, t)
            out.extend((t, trip) for trip in trips)
        return out

    for name in ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"):
        monkeypatch.setattr(f"time.{name}", forbidden)
    monkeypatch.setattr("builtins.open", forbidden)
    first = run()
    assert first and run() == first


def test_trips_of_one_poll_come_in_rule_order():
    """Rules run in their declared order, so a hardware Xid's trip precedes an application-Xid rate
    trip of the same poll (the executor tells the job the first of the strongest)."""
    policy = Policy(dataclasses.replace(PolicyConfig(), app_xid_max_per_hour=1))
    g = GpuReading(index=0, uuid="GPU-0", pci_bus_id="0000:18:00.0", values={"temperature_celsius": 95.0,
                                                                                "slowdown_temperature_celsius": 87.0})
    xids = tuple(XidEvent(gpu=0, xid=x, source="nvml") for x in (13, 13, 79))
    _, trips = policy.decide(PolicyState(), NodeReadings(time=0, driver_version="t", gpus=(g,), xid_events=xids), 0.0)
    assert [(t.rule, t.action) for t in trips] == [("xid", "alert"), ("xid", "migrate"), ("app_xid_rate", "migrate"),
                                                   ("thermal", "alert")]


# -- discovery -------------------------------------------------------------------------------------
def make_package(tmp_path, monkeypatch, name, modules):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod, text in modules.items():
        (pkg / f"{mod}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, [str(pkg)]


RULE_MODULE = """
from sentinel.rules.base import Finding, GpuRule

class R(GpuRule):
    '''A test rule.'''
    name = {name!r}
    order = {order}

    def evaluate(self, ctx, cfg):
        return ()

RULE = R()
"""


def test_discovery_orders_rules_and_rejects_mistakes(tmp_path, monkeypatch):
    ok = make_package(tmp_path, monkeypatch, "rules_ok", {
        "b": RULE_MODULE.format(name="b", order=1), "a": RULE_MODULE.format(name="a", order=2), "_helper": "X = 1\n"})
    assert [r.name for r in rules.discover(*ok)] == ["b", "a"]
    missing = make_package(tmp_path, monkeypatch, "rules_missing", {"a": "X = 1\n"})
    with pytest.raises(ImportError, match="rules_missing.a defines no RULE"):
        rules.discover(*missing)
    twice = make_package(tmp_path, monkeypatch, "rules_twice", {
        "a": RULE_MODULE.format(name="same", order=1), "b": RULE_MODULE.format(name="same", order=2)})
    with pytest.raises(ValueError, match="same name"):
        rules.discover(*twice)


# -- the worked example in docs/policy.md ("Adding a rule") runs as written ------------------------
def docs_block(language):
    section = DOCS[DOCS.index("## Adding a rule"):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def test_the_documented_example_rule_works_as_a_new_module(tmp_path, monkeypatch):
    name, path = make_package(tmp_path, monkeypatch, "example_rules", {"hw_slowdown": docs_block("python")})
    (example,) = rules.discover(name, path)
    test_rule_declares_name_docs_fields_and_config(example)
    sc = tomllib.loads(docs_block("toml"))
    cfg = scenarios.config_for(sc)
    monkeypatch.setattr(scenarios, "Policy", lambda c: Policy(c, rules=(*rules.REGISTRY, example)))
    got = [(trip.rule, trip.action, t) for t, trip in scenarios.replay(sc, cfg).trips]
    assert got == [(e["rule"], e["action"], float(e["at"])) for e in sc["expect"]]
    # and on a GPU that does not report the field it needs, the rule is inactive
    g = GpuReading(index=0, uuid="GPU-0", pci_bus_id="0000:18:00.0", unsupported=frozenset({"throttle_reasons"}))
    assert Policy(cfg, rules=(*rules.REGISTRY, example)).rule_active(g)[(example.name, 0)] is False
