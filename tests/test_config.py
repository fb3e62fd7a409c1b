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

    def check(name, cls):
        assert f"[{name}]" in text
        for f in dataclasses.fields(cls):
            sub = getattr(config.Config(), name.split(".")[0])
            for part in name.split(".")[1:]:
                sub = getattr(sub, part)
            value = getattr(sub, f.name)
            if dataclasses.is_dataclass(value):  # a nested table: [actions.slurm]
                check(f"{name}.{f.name}", type(value))
            else:
                assert f"\n{f.name} = " in text, f"{name}.{f.name} is not documented"

    for section in dataclasses.fields(config.Config):
        check(section.name, type(getattr(config.Config(), section.name)))


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
    ("[actions]\nbackend = \"pbs\"\n", "actions.backend"),
    ("[actions]\ncordon_command = [\"x\"]\n", "actions.cordon_command"),
    ("[actions]\nbreaker_max_fraction = 1.5\n", "actions.breaker_max_fraction"),
    ("[actions.slurm]\nscontorl = \"x\"\n", "actions.slurm.scontorl"),
    ("[actions.kubernetes]\ntaint_key = \"a b\"\n", "actions.kubernetes.taint_key"),
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


# -- values that parse but are wrong -----------------------------------------------------------------
@pytest.mark.parametrize("text,key", [
    ("[daemon]\npoll_interval_seconds = 1e308\n", "daemon.poll_interval_seconds"),  # killed the loop
    ("[daemon]\npoll_interval_seconds = 86401\n", "daemon.poll_interval_seconds"),
    ("[daemon]\nnvml_deadline_seconds = inf\n", "daemon.nvml_deadline_seconds"),
    ("[daemon]\nnvml_deadline_seconds = 3601\n", "daemon.nvml_deadline_seconds"),
    ("[daemon]\nruntime_dir = \"\"\n", "daemon.runtime_dir"),
    ("[daemon]\nstate_dir = \"/var/\\u0000x\"\n", "daemon.state_dir"),
    ("[policy]\nlead_time_seconds = nan\n", "policy.lead_time_seconds"),
    ("[policy]\ncooldown_seconds = nan\n", "policy.cooldown_seconds"),  # `nan < 0` is False: passed before
    ("[policy]\ncooldown_seconds = -inf\n", "policy.cooldown_seconds"),
    ("[policy]\nretired_pages_limit = -1\n", "policy.retired_pages_limit"),  # a healthy node cordoned itself
    ("[policy]\nretired_pages_limit = 0\n", "policy.retired_pages_limit"),
    ("[policy]\nretired_dbe_limit = -1\n", "policy.retired_dbe_limit"),
    ("[policy]\nremap_uncorrectable_limit = 0\n", "policy.remap_uncorrectable_limit"),
    ("[policy]\napp_xid_max_per_hour = -5\n", "policy.app_xid_max_per_hour"),
    ("[policy]\ndebounce_samples = 9223372036854775807\n", "policy.debounce_samples"),
    ("[policy]\nnvlink_crc_per_second_limit = 0\n", "policy.nvlink_crc_per_second_limit"),
    ("[policy]\nnvlink_crc_per_second_limit = nan\n", "policy.nvlink_crc_per_second_limit"),
    ("[policy]\npcie_replay_ber = -1e-12\n", "policy.pcie_replay_ber"),
    ("[policy]\npcie_replay_ber = 2\n", "policy.pcie_replay_ber"),
    ("[policy]\nxid_overrides = { \"\u00b2\" = \"alert\" }\n", "policy.xid_overrides"),  # isdigit() said yes
    ("[policy]\nxid_overrides = { \"\u0667\u0669\" = \"alert\" }\n", "policy.xid_overrides"),  # Arabic-Indic 79
    ("[policy]\nxid_overrides = { \"079\" = \"alert\" }\n", "policy.xid_overrides.079"),
    ("[policy]\nxid_overrides = { \"0\" = \"alert\" }\n", "policy.xid_overrides.0"),
    ("[policy]\nxid_overrides = { \"65536\" = \"alert\" }\n", "policy.xid_overrides.65536"),
    ("[policy]\nxid_skip = [0]\n", "policy.xid_skip[0]"),
    ("[policy]\nxid_skip = [79, -1]\n", "policy.xid_skip[1]"),
    ("[policy]\nxid_skip = [65536]\n", "policy.xid_skip[0]"),
    ("[actions]\nack_timeout_seconds = 1e308\n", "actions.ack_timeout_seconds"),
    ("[actions]\nack_timeout_seconds = nan\n", "actions.ack_timeout_seconds"),
    ("[actions]\ncordon_command = [\"\", \"x\"]\n", "actions.cordon_command[0]"),
    ("[actions]\nspare_command = [\"ssh\", \"a\\u0000b\"]\n", "actions.spare_command[1]"),
])
def test_wrong_values_are_rejected_naming_the_key(text, key):
    with pytest.raises(config.ConfigError) as exc:
        config.parse(text)
    assert str(exc.value).startswith(key), str(exc.value)


def _fields(section_name):
    import dataclasses

    section = getattr(config.Config(), section_name)
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(section)]


SECTIONS = ("daemon", "metrics", "policy", "actions", "ebpf")


@pytest.mark.parametrize("section", SECTIONS)
def test_no_number_key_accepts_inf_or_nan(section):
    numbers = [name for name, default in _fields(section) if isinstance(default, float)]
    for name in numbers:
        for bad in ("inf", "-inf", "nan"):
            with pytest.raises(config.ConfigError, match=f"^{section}.{name}:"):
                config.parse(f"[{section}]\n{name} = {bad}\n")


@pytest.mark.parametrize("section", ("daemon", "policy", "actions"))
def test_every_number_key_has_a_range(section):
    """A key added later without a range fails here, not on a node."""
    for name, default in _fields(section):
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        for bad in ("-1", "1e308" if isinstance(default, float) else "9223372036854775807"):
            with pytest.raises(config.ConfigError, match=f"^{section}.{name}:"):
                config.parse(f"[{section}]\n{name} = {bad}\n")


def test_a_config_that_validates_can_be_applied():
    """Every value at the edges of its range builds a Policy (on SIGHUP a Policy that fails to build
    used to kill the running daemon)."""
    from sentinel.policy import Policy

    cfg = config.parse(
        "[policy]\n"
        "xid_overrides = { \"1\" = \"migrate\", \"65535\" = \"ignore\", \"79\" = \"alert\" }\n"
        "xid_skip = [1, 65535]\nretired_pages_limit = 1\nretired_dbe_limit = 0\nremap_uncorrectable_limit = 1\n"
        "app_xid_max_per_hour = 0\ndebounce_samples = 10000\nlead_time_seconds = 604800\ncooldown_seconds = 0\n"
        "pcie_replay_ber = 1\nnvlink_crc_per_second_limit = 1e12\ndisabled_rules = [\"thermal\"]\n"
    )
    policy = Policy(cfg.policy)
    assert policy.xid_action[79] == "alert" and policy.xid_action[65535] == "ignore" and policy.xid_action[1] == "ignore"


def test_non_utf8_file_is_a_config_error_naming_the_file(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[daemon]\nnode_name = \"n\xe9ud\"\n")
    with pytest.raises(config.ConfigError) as exc:
        config.load(bad)
    assert str(exc.value).startswith(f"{bad}: not a UTF-8 text file")
    r = subprocess.run([sys.executable, "-m", "sentinel", "check-config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and str(bad) in r.stderr and "UTF-8" in r.stderr and "Traceback" not in r.stderr


def test_validating_a_config_does_not_import_the_policy():
    """config -> policy -> config was a circular import; the rule names are config's own."""
    code = ("import sys; from sentinel import config; "
            "config.parse('[policy]\\ndisabled_rules = [\"thermal\"]\\n'); "
            "assert 'sentinel.policy' not in sys.modules, 'config imported the policy'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_rule_names_match_the_policy_rules():
    from sentinel.policy import RULES

    assert config.RULE_NAMES == set(RULES)


def test_command_line_overrides_are_validated(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel", "run", "--port", "70000", "--runtime-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "metrics.port" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was created


# -- reload plan -------------------------------------------------------------------------------------
def test_reload_plan_splits_live_changes_from_restart_ones():
    old = config.Config()
    assert config.reload_plan(old, config.parse("")) == ([], [])
    new = config.parse(
        "[daemon]\npoll_interval_seconds = 5\nlog_level = \"debug\"\nruntime_dir = \"/run/other\"\n"
        "[metrics]\nport = 9999\n[policy]\nretired_pages_limit = 10\n[actions]\ndrain = false\n"
        "[ebpf]\nenabled = false\n"
    )
    applied, restart = config.reload_plan(old, new)
    assert sorted(applied) == ["actions", "daemon.log_level", "daemon.poll_interval_seconds", "policy"]
    assert sorted(restart) == ["daemon.runtime_dir", "ebpf.enabled", "metrics.port"]


def test_live_part_keeps_restart_keys_at_their_running_values():
    old = config.Config()
    new = config.parse("[daemon]\npoll_interval_seconds = 5\nstate_dir = \"/srv/s\"\n[metrics]\nport = 9999\n"
                       "[policy]\nretired_pages_limit = 10\n")
    running = config.live_part(old, new)
    assert running.daemon.poll_interval_seconds == 5 and running.policy.retired_pages_limit == 10
    assert running.daemon.state_dir == old.daemon.state_dir and running.metrics.port == old.metrics.port
    # so the next reload of the same file reports the pending restart again, and nothing to apply
    assert config.reload_plan(running, new) == ([], ["daemon.state_dir", "metrics.port"])


def test_backend_keys_need_a_restart_but_the_rest_of_actions_reloads_live():
    old = config.Config()
    new = config.parse('[actions]\nbackend = "slurm"\nack_timeout_seconds = 5.0\n[actions.slurm]\npartition = "gpu"\n')
    live, restart = config.reload_plan(old, new)
    assert live == ["actions"] and sorted(restart) == ["actions.backend", "actions.slurm"]
    running = config.live_part(old, new)
    assert running.actions.backend == "file" and running.actions.slurm.partition == ""
    assert running.actions.ack_timeout_seconds == 5.0
    assert config.reload_plan(running, new)[1] == restart  # still pending at the next reload
