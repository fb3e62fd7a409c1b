"""The PyTorch side of Sentinel: snapshot on the daemon's request, agreed by all ranks.

    guard = SnapshotGuard(ckpt_dir, {"app": ModelOptimState(model, optim)})
    start = guard.resume()
    for step in range(start, total_steps):
        train_step(step)
        guard.step(step)

The names below load on first use (importing them imports torch); the pure parts
(``trainer.memory.slot``, ``trainer.memory.plan``) import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SnapshotGuard", "ModelOptimState", "NodeDrained", "complete_snapshots"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("trainer.guard"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
