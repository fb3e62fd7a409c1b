"""The one wiring place: sentinel.builder.build_daemon makes every part, then one Daemon(...)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sentinel import config
from sentinel.builder import build_daemon
from sentinel.daemon import StartupError
from sentinel.sources.rank_signals import RankSignalSource

BUILDER = Path(__file__).resolve().parents[1] / "sentinel" / "builder.py"


def cfg_for(tmp_path: Path, extra: str = "") -> config.Config:
    return config.parse(f'[daemon]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                        f'node_name = "n1"\n[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n{extra}')


def test_the_daemon_gets_one_channel_one_migrator_and_the_rank_source_sees_the_channels_ranks(sim_state, tmp_path):
    daemon = build_daemon(cfg_for(tmp_path), simulate=str(sim_state))
    try:
        assert daemon.executor.trainer is daemon.endpoint and daemon.executor.migrator is daemon.migrator
        assert daemon.migrator.endpoint is daemon.endpoint
        (rank_source,) = [s for s in daemon.event_sources if isinstance(s, RankSignalSource)]
        assert rank_source.ranks_provider is not None
        assert sorted(rank_source.ranks_provider()) == sorted(daemon.endpoint.ranks())  # no rank registered: both empty
        assert (tmp_path / "run" / "daemon.sock").exists()
    finally:
        daemon.close()
    assert not (tmp_path / "run" / "daemon.sock").exists()


def test_a_backend_that_cannot_start_closes_the_channel_it_opened(sim_state, tmp_path):
    cfg = cfg_for(tmp_path, f'[actions]\nbackend = "kubernetes"\n[actions.kubernetes]\nkubeconfig = "{tmp_path / "none"}"\n')
    with pytest.raises(StartupError, match="actions.backend = 'kubernetes'"):
        build_daemon(cfg, simulate=str(sim_state))
    assert (tmp_path / "run").is_dir() and not (tmp_path / "run" / "daemon.sock").exists()


def test_the_builder_calls_daemon_once_and_sets_nothing_on_it_afterwards():
    tree = ast.parse(BUILDER.read_text())
    (build,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_daemon"]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Daemon"]
    assert len(calls) == 1 and isinstance(build.body[-1], ast.Return) and build.body[-1].value is calls[0]
    assigned = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)]
    assert not assigned, "the builder passes parts to constructors; it sets no attribute on what it built"
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Compare) and any(
        isinstance(side, ast.Attribute) and side.attr == "name" for side in [n.left, *n.comparators])]
    assert not names, "the builder finds no part by its name string"
