"""The topology's way into the daemon: [actions.topology] validation, the command backend's
recorded spare choice, and a migration that records it (file/command backends, no scheduler)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

import pytest

from conftest import register_agent, wait_for
from sentinel import config
from sentinel.backends import make_backend
from sentinel.backends.base import BackendContext
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import ActionsConfig, ConfigError
from sentinel.migration import Migrator
from sentinel.policy import Trip


@pytest.mark.parametrize("text,key", [
    ("[actions.topology]\nleaf = 1\n", "actions.topology.leaf"),
    ("[actions.topology]\nbreaker_max_leaf_fraction = 0\n", "actions.topology.breaker_max_leaf_fraction"),
    ("[actions.topology]\nbreaker_max_nvlink_fraction = 1.5\n", "actions.topology.breaker_max_nvlink_fraction"),
    ("[actions.topology]\nfrom_scheduler = \"yes\"\n", "actions.topology.from_scheduler"),
])
def test_bad_topology_config_names_the_key(text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.parse(text)


def command_backend(tmp_path, script: str):
    actions = ActionsConfig(backend="command", spare_command=(sys.executable, "-c", script, "{node}"))
    return make_backend(actions, BackendContext(node="node1", state_dir=tmp_path, runtime_dir=tmp_path, timeout=30.0,
                                                wall=time.time))


def test_the_spare_commands_choice_is_recorded(tmp_path):
    choice = {"node": "spare1", "distance": "leaf", "rank": 2, "why": "spare1 shares the leaf switch leafA with node1"}
    b = command_backend(tmp_path, f"import sys; print('claimed'); print('sentinel-spare-choice ' + {json.dumps(json.dumps(choice))})")
    said = b.start_spare()
    assert b.spare_choice is not None and b.spare_choice.as_dict() == choice
    assert "spare1 (leaf: spare1 shares the leaf switch leafA with node1)" in said


@pytest.mark.parametrize("line", ["sentinel-spare-choice {not json", 'sentinel-spare-choice {"node": 3}',
                                  'sentinel-spare-choice ["a"]'])
def test_a_malformed_choice_line_is_ignored_not_fatal(tmp_path, line):
    b = command_backend(tmp_path, f"print({line!r})")
    assert b.start_spare().endswith("ok") and b.spare_choice is None


def test_a_migration_records_the_choice_and_counts_it(tmp_path):
    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    (tmp_path / "state").mkdir()
    choice = {"node": "spare1", "distance": "nvlink", "rank": 1, "why": "spare1 shares the NVLink domain nvl-0 with node1"}
    actions = ActionsConfig(backend="command", ack_timeout_seconds=0.5, drain=False,
                            spare_command=(sys.executable, "-c", f"print('sentinel-spare-choice ' + {json.dumps(json.dumps(choice))})"))
    m = Migrator(actions, ep, state_dir=tmp_path / "state", runtime_dir=run_dir, node="node1",
                 signal_agent=lambda rec, sig: None, workers=concurrent.futures.ThreadPoolExecutor(2))
    try:
        m.begin("r1", Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79", values={}))
        record = tmp_path / "state" / "migration.json"
        wait_for(lambda: (m.tick([]), json.loads(record.read_text()).get("spare"))[1] is not None, timeout=30,
                 what="the spare choice on disk")
        saved = json.loads(record.read_text())
        assert saved["spare"] == choice and "spare_chosen" in saved["times"]
        assert m.metric_counters()[("sentinel_spare_choices", (("distance", "nvlink"),))] == 1
    finally:
        m.close()
        ep.close()


def test_a_failed_spare_call_is_on_disk_with_its_answer_time(tmp_path):
    """The spare is asked for without waiting (it warms while the snapshot is written); whatever
    the call answers is saved with ``times.spare_called``, so a reader of the record (the drill's
    report, an operator) can tell an unanswered call from one that found no spare."""
    run_dir = tmp_path / "run"
    register_agent(run_dir)
    ep = DaemonEndpoint(run_dir)
    (tmp_path / "state").mkdir()
    actions = ActionsConfig(backend="command", ack_timeout_seconds=0.5, drain=False,
                            spare_command=(sys.executable, "-c", "import sys; sys.exit('no spare in the pool')"))
    m = Migrator(actions, ep, state_dir=tmp_path / "state", runtime_dir=run_dir, node="node1",
                 signal_agent=lambda rec, sig: None, workers=concurrent.futures.ThreadPoolExecutor(2))
    try:
        m.begin("r1", Trip(rule="xid", action="migrate", gpu=0, cause="xid:79", message="Xid 79", values={}))
        record = tmp_path / "state" / "migration.json"
        wait_for(lambda: (m.tick([]), "spare_called" in json.loads(record.read_text())["times"])[1], timeout=30,
                 what="the spare call's answer on disk")
        saved = json.loads(record.read_text())
        assert saved.get("spare") is None and "spare_chosen" not in saved["times"]
        assert any(n.startswith("no spare started: spare command") and "no spare in the pool" in n for n in saved["notes"])
    finally:
        m.close()
        ep.close()


def test_sentinel_topology_prints_the_model_and_the_choice_and_names_a_contradiction(tmp_path):
    import subprocess

    from conftest import REPO

    good = tmp_path / "t.toml"
    good.write_text('[nodes.n1]\nswitches = ["leafA"]\n[nodes.far]\nswitches = ["leafB"]\n[nodes.near]\nswitches = ["leafA"]\n')
    r = subprocess.run([sys.executable, "-m", "sentinel", "topology", "--file", str(good), "--for", "n1",
                        "--spares", "far,near"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "n1: nvlink=? switches=leafA" in r.stdout and "spare for n1: near (leaf)" in r.stdout
    bad = tmp_path / "topology.conf"
    bad.write_text("SwitchName=a Nodes=n1\nSwitchName=b Nodes=n1\n")
    r = subprocess.run([sys.executable, "-m", "sentinel", "topology", "--file", str(bad)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 1 and f"{bad}: node n1 is under two leaf switches" in r.stderr
