"""``sentinel topology``: the model the daemon would use (its file and its scheduler's, as
configured, plus ``--file``), one line per node, and the spare it would choose for ``--for``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable


def run(args: argparse.Namespace, cfg: Any, *, node: str, fail: Callable[..., int]) -> int:
    from sentinel import topology
    from sentinel.backends import make_backend
    from sentinel.backends.base import BackendContext, BackendError

    ctx = BackendContext(node=node, state_dir=Path(cfg.daemon.state_dir), runtime_dir=Path(cfg.daemon.runtime_dir),
                         timeout=cfg.actions.command_timeout_seconds, wall=time.time)
    try:
        readings = []
        for f in args.file:
            readings += topology.read_file(f)
        b = make_backend(cfg.actions, ctx)
        tc = cfg.actions.topology
        readings += topology.read_file(tc.file) if tc.file else []
        readings += b.scheduler_topology() if tc.from_scheduler else []
        topo = topology.merge(readings)
    except (topology.TopologyError, BackendError) as exc:
        return fail(f"topology: {exc}", 1)
    print("\n".join(topo.describe()) or "no node is placed: every choice falls back to today's order")
    if args.spares:
        choice = topology.choose_spare(topo, args.departed or node, args.spares.split(","))
        if choice is not None:
            print(f"spare for {args.departed or node}: {choice.node} ({choice.distance}): {choice.why}")
    return 0
