from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from sentinel import config


def test_default_file_documents_exactly_the_defaults():
    assert config.load(REPO / "systemd" / "sentinel.toml") == config.Config()


def test_every_key_is_documented_in_the_default_file():
    text = (REPO / "systemd" / "sentinel.toml").read_text()
    import dataclasses

    for section in dataclasses.fields(config.Config):
        assert f"[{section.name}]" in text
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else getattr(config, section.type)):
            assert f"\n{f.name} = " in text, f"{section.name}.{f.name} is not documented"


@pytest.mark.parametrize("text,key", [
    ("[daemon]\npoll_interval = 1\n", "daemon.poll_interval"),
    ("[nope]\n", "nope"),
    ("[daemon]\npoll_interval_seconds = \"fast\"\n", "daemon.poll_interval_seconds"),
    ("[daemon]\npoll_interval_seconds = -1\n", "daemon.poll_interval_seconds"),
    ("[metrics]\nport = 70000\n", "metrics.port"),
    ("[policy]\nxid_overrides = { \"79\" = \"explode\" }\n", "policy.xid_overrides.79"),
    ("[policy]\nxid_overrides = { \"abc\" = \"alert\" }\n", "policy.xid_overrides.abc"),
    ("[policy]\ndisabled_rules = [\"no_such_rule\"]\n", "policy.disabled_rules"),
    ("[policy]\nxid_skip = [\"13\"]\n", "policy.xid_skip[0]"),
    ("[actions]\ndrain = 1\n", "actions.drain"),
])
def test_bad_config_names_the_key(text, key):
    with pytest.raises(config.ConfigError) as exc:
        config.parse(text)
    assert str(exc.value).startswith(key + ":") or key in str(exc.value)


def test_overrides_parse():
    cfg = config.parse('[policy]\nxid_overrides = { "94" = "migrate" }\nxid_skip = [13]\n')
    assert cfg.policy.xid_overrides["94"] == "migrate" and cfg.policy.xid_skip == (13,)


def test_check_config_cli(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[daemon]\npoll_interval = 1\n")
    r = subprocess.run([sys.executable, "-m", "sentinel", "check-config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "daemon.poll_interval: unknown key" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "check-config", str(REPO / "systemd/sentinel.toml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "check-config", str(tmp_path / "missing.toml")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "cannot read config file" in r.stderr
