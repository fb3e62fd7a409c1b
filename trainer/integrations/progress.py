"""The job's progress record: one JSON line per event, the same lines ``trainer/train.py`` writes
(``admitted``, ``resumed``, ``step``, ``snapshot``, ``drained``, ``finished``, ``exited``), so
``sentinel drill`` and ``bench/migration.py`` read a Lightning or TorchTitan job as they read ours.

An integration writes them only where the job was given a file: ``SENTINEL_PROGRESS_FILE`` in
its environment (the drill sets it), or the integration's own ``progress=`` option. The final
parameters' digest goes to ``SENTINEL_FINAL_FILE`` (``--verify`` compares it bitwise). A user's job
with neither set writes nothing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

PROGRESS_ENV = "SENTINEL_PROGRESS_FILE"
FINAL_ENV = "SENTINEL_FINAL_FILE"


class ProgressRecord:
    """Appends events to ``path`` (O_APPEND: whole lines from many ranks); a no-op without a path."""

    def __init__(self, path: str | os.PathLike | None, *, rank: int = 0, world: int = 1) -> None:
        self.path = str(path) if path else ""
        self.rank, self.world = rank, world
        self.node = os.environ.get("SENTINEL_NODE", socket.gethostname())

    @classmethod
    def from_env(cls, path: str | os.PathLike | None = None, **kwargs: Any) -> "ProgressRecord":
        return cls(path or os.environ.get(PROGRESS_ENV, ""), **kwargs)

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = {"event": event, "rank": self.rank, "world": self.world, "node": self.node, "pid": os.getpid(),
                "time": time.time(), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def write_final(digests: dict[str, str], **fields: Any) -> None:
    """Rank 0: the final parameters' and optimizer state's digests, where ``SENTINEL_FINAL_FILE`` says."""
    path = os.environ.get(FINAL_ENV, "")
    if path:
        Path(path).write_text(json.dumps({**digests, **fields}, default=str))
