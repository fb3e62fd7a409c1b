"""The extension costs docs/extending.md states, kept true.

* A backend with settings of its own is one module: a throwaway ``sentinel/backends/acme.py``,
  dropped into a copy of the package with no other edit, is a valid ``backend = "acme"`` whose
  ``[actions.acme]`` table is parsed, range-checked, built and restart-only on reload.
* A rule with a threshold is one module plus one scenario: a throwaway
  ``sentinel/rules/power_draw.py`` and ``tests/scenarios/power_draw.toml`` in a copy give a
  ``[policy]`` key with the rule's default and range, and the scenario's trips replay exactly.
* ``systemd/sentinel.toml`` states every rule key as its ``ConfigKey`` declares it.

(A new NVML field is one declaration: tests/test_fields.py; a kernel-log signature is one catalog
entry plus one corpus line: tests/test_signatures.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from sentinel import rules

REPO = Path(__file__).resolve().parents[1]
TOML = REPO / "systemd" / "sentinel.toml"

ACME = '''
"""``backend = "acme"``: a throwaway backend with a settings table of its own."""

from dataclasses import dataclass

from sentinel import settings
from sentinel.backends.base import Backend


@dataclass(frozen=True)
class AcmeSettings:
    # The scheduler's API.
    url: str = "https://scheduler.invalid/api"
    # Seconds a cordon may take.
    patience_seconds: float = 5.0

    def validate(self, prefix):
        settings.text(prefix, "url", self.url)
        settings.number(prefix, "patience_seconds", self.patience_seconds, 0, 60, low_open=True)


SETTINGS = AcmeSettings


class AcmeBackend(Backend):
    name = "acme"


BACKEND = AcmeBackend
'''

ACME_CHECK = '''
import json, sys, time
from pathlib import Path
from sentinel import backends, config
from sentinel.backends.base import BackendContext

out = {"names": list(backends.NAMES)}
cfg = config.parse('[actions]\\nbackend = "acme"\\n[actions.acme]\\nurl = "https://acme.example/api"\\n')
out["url"] = cfg.actions.acme.url
out["default"] = config.Config().actions.acme.patience_seconds
try:
    config.parse('[actions.acme]\\npatience_seconds = 600.0\\n')
except config.ConfigError as exc:
    out["error"] = str(exc)
try:
    config.parse('[actions.acme]\\nurll = "x"\\n')
except config.ConfigError as exc:
    out["unknown"] = str(exc)
ctx = BackendContext(node="n1", state_dir=Path(sys.argv[1]), runtime_dir=Path(sys.argv[1]), timeout=1.0, wall=time.time)
backend = backends.make_backend(cfg.actions, ctx)
out["built"] = [type(backend).__name__, backend.cfg.acme.url]
new = config.parse('[actions]\\nbackend = "acme"\\n[actions.acme]\\nurl = "https://other.example/api"\\n')
out["reload"] = config.reload_plan(cfg, new)
print(json.dumps(out))
'''

POWER_DRAW = '''
"""``power_draw``: a throwaway rule with a threshold of its own."""

from sentinel.rules.base import ConfigKey, Finding, GpuRule

POWER_DRAW_LIMIT_WATTS = ConfigKey("power_draw_limit_watts", 800.0, "a test's made-up limit, twice an idle H100",
                                   0, 10_000, low_open=True)


class PowerDraw(GpuRule):
    """Power draw at or above ``power_draw_limit_watts`` → ``alert``. Source: a test."""

    name = "power_draw"
    fields = ("power_watts",)
    config = (POWER_DRAW_LIMIT_WATTS,)
    order = 990

    def evaluate(self, ctx, cfg):
        watts = ctx.values.get("power_watts")
        if watts is None or watts < cfg.power_draw_limit_watts:
            return ()
        return (Finding("alert", self.name, f"{watts:.0f} W", {"power_watts": watts}),)


RULE = PowerDraw()
'''

POWER_SCENARIO = '''
name = "power_draw"
kind = "benign"
description = "Power draw over the limit for two minutes: one alert (the cooldown holds the rest)."
poll_seconds = 10
duration_seconds = 1800
seed = 3

[[set]]
at = 600
field = "power_watts"
value = 900

[[set]]
at = 720
field = "power_watts"
value = 300

[[expect]]
rule = "power_draw"
action = "alert"
at = 600
'''

RULE_CHECK = '''
import json
from sentinel import config, rules
from sentinel_tools import scenarios

out = {"registered": "power_draw" in rules.RULE_NAMES, "default": config.PolicyConfig().power_draw_limit_watts,
       "set": config.parse("[policy]\\npower_draw_limit_watts = 900.0\\n").policy.power_draw_limit_watts}
try:
    config.parse("[policy]\\npower_draw_limit_watts = 0.0\\n")
except config.ConfigError as exc:
    out["error"] = str(exc)
out["disable"] = config.parse('[policy]\\ndisabled_rules = ["power_draw"]\\n').policy.disabled_rules
sc = scenarios.load("tests/scenarios/power_draw.toml")
result = scenarios.replay(sc, scenarios.config_for(sc))
out["trips"] = [[trip.rule, trip.action, at] for at, trip in result.trips]
out["expect"] = [[e["rule"], e["action"], float(e["at"])] for e in sc["expect"]]
print(json.dumps(out))
'''


def copy_of_the_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    for package in ("sentinel", "sentinel_tools"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests" / "scenarios", root / "tests" / "scenarios")
    return root


def run_in(root: Path, code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_new_backend_with_settings_is_one_module(tmp_path):
    root = copy_of_the_tree(tmp_path)
    (root / "sentinel" / "backends" / "acme.py").write_text(ACME)
    out = run_in(root, ACME_CHECK, str(tmp_path))
    assert "acme" in out["names"]
    assert out["url"] == "https://acme.example/api" and out["default"] == 5.0
    assert out["error"].startswith("actions.acme.patience_seconds: must be a finite number in (0, 60]")
    assert out["unknown"].startswith("actions.acme.urll: unknown key")
    assert out["built"] == ["AcmeBackend", "https://acme.example/api"]
    assert out["reload"] == [[], ["actions.acme"]]  # the backend is built once, at start


def test_a_new_rule_with_a_threshold_is_one_module_and_one_scenario(tmp_path):
    root = copy_of_the_tree(tmp_path)
    (root / "sentinel" / "rules" / "power_draw.py").write_text(POWER_DRAW)
    (root / "tests" / "scenarios" / "power_draw.toml").write_text(POWER_SCENARIO)
    out = run_in(root, RULE_CHECK)
    assert out["registered"] and out["default"] == 800.0 and out["set"] == 900.0
    assert out["error"].startswith("policy.power_draw_limit_watts: must be a finite number in (0, 10000]")
    assert out["disable"] == ["power_draw"]
    assert out["trips"] == out["expect"] == [["power_draw", "alert", 600.0]]


def _policy_block(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("[policy]")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("["))
    return lines[start + 1:end]


def test_the_default_file_states_each_rule_key_as_declared():
    block = _policy_block(TOML.read_text())
    values = tomllib.loads("\n".join(block))
    problems = []
    for key in rules.CONFIG_KEYS:
        default = key.default if not isinstance(key.default, tuple) else list(key.default)
        want = f"{key.name} = {_toml(key.default)}"
        if key.name not in values:
            problems.append(f"  missing: add under [policy] a comment saying what it does{_range(key)}, then\n    {want}")
            continue
        if values[key.name] != default:
            problems.append(f"  {key.name}: the file says {values[key.name]!r}, the declaration {key.default!r}: {want}")
        at = next(i for i, line in enumerate(block) if line.startswith(f"{key.name} ="))
        comment = []
        for line in reversed(block[:at]):
            if not line.startswith("#"):
                break
            comment.insert(0, line)
        if key.range_text() and key.range_text() not in " ".join(comment):
            problems.append(f"  {key.name}: its comment must state the declared range {key.range_text()!r}")
    assert not problems, ("systemd/sentinel.toml disagrees with the rules' ConfigKey declarations "
                          "(sentinel/rules/*.py; the declaration is the truth):\n" + "\n".join(problems))


def _range(key: rules.ConfigKey) -> str:
    return f" and its range, {key.range_text()}" if key.range_text() else ""


def _toml(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{ " + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + " }"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def test_range_text_reads_as_the_default_file_writes_it():
    key = rules.ConfigKey
    assert key("a", 3, "s s", 1, 10_000).range_text() == "1..10000"
    assert key("b", 1.0, "s s", 0, 7 * 86400.0, low_open=True).range_text() == "0 < x <= 604800"
    assert key("c", 1.0, "s s", 0, 1e12, low_open=True).range_text() == "0 < x <= 1e12"
    assert key("d", 1e-12, "s s", 0, 1, low_open=True).range_text() == "0 < x <= 1"
    try:
        key("e", 5, "s s")
    except TypeError as exc:
        assert "range" in str(exc)
    else:
        raise AssertionError("a number without a range was accepted")
