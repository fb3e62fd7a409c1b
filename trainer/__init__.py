"""The PyTorch side of Sentinel: snapshot on the daemon's request, agreed by all ranks.

    guard = SnapshotGuard(ckpt_dir, {"app": ModelOptimState(model, optim)})
    start = guard.resume()
    for step in range(start, total_steps):
        train_step(step)
        guard.step(step)
    guard.close()
    ...
    destroy_process_groups()   # last, when the guard and the model are gone (trainer.shutdown)

The names below load on first use (importing them imports torch); the pure parts
(``trainer.memory.slot``, ``trainer.memory.plan``) import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SnapshotGuard", "ModelOptimState", "NodeDrained", "complete_snapshots", "destroy_process_groups"]
_HOME = {"destroy_process_groups": "trainer.shutdown"}  # the rest: trainer.guard


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME.get(name, "trainer.guard")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
