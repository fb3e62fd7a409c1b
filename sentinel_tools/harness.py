"""What every drill module shares: its error, its bounded waits that say what they wait for, and
the process helpers (a process's descendants, whether a pid still runs)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from sentinel.procs import running

# drill --trainer lightning / torchtitan: the job's script, and what a warm agent preloads for it
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TRAINER_JOBS = {"lightning": (EXAMPLES / "lightning_job.py", ("lightning.pytorch", "trainer.integrations.lightning")),
                "torchtitan": (EXAMPLES / "torchtitan_job.py", ("torchtitan.components.checkpoint",
                                                                "trainer.integrations.torchtitan"))}

PROGRESS_EVERY = 15.0  # seconds between "still waiting" lines on stderr


class DrillError(RuntimeError):
    pass


def progress(message: str, out: Any = None) -> None:
    """One progress line on stderr (stdout stays the result: the timeline or --json)."""
    print(f"sentinel drill {time.strftime('%H:%M:%S')}: {message}", file=out or sys.stderr, flush=True)


def wait(predicate, timeout: float, what: str, *, clock=time.monotonic, sleep=time.sleep,
         report_every: float = PROGRESS_EVERY, out: Any = None) -> None:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (DrillError). Says on
    stderr what it waits for, and again every ``report_every`` seconds while it waits."""
    start = clock()
    end = start + timeout
    next_report = start + report_every
    progress(f"waiting for {what} (up to {timeout:.0f} s)", out)
    while clock() < end:
        if predicate():
            return
        now = clock()
        if now >= next_report:
            progress(f"still waiting for {what}: {now - start:.0f} s of {timeout:.0f} s", out)
            next_report = now + report_every
        sleep(0.05)
    raise DrillError(f"timed out after {timeout:.0f} s waiting for {what}")


def alive(pid: int) -> bool:
    """``pid`` runs (a dead spare must be noticed while it is a zombie): :func:`sentinel.procs.running`."""
    return running(pid)


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def pythonpath() -> str:
    """This checkout first, then the caller's PYTHONPATH: every process a drill starts imports
    the same sentinel and trainer as the drill."""
    parts = [str(repo_root())] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)


def trainer_job_argv(trainer: str, a: Any, root: Path, devices: int, nodes: int) -> list[str]:
    """The Lightning or TorchTitan example job's command line (its Sentinel settings: the environment)."""
    script = str(TRAINER_JOBS[trainer][0])
    if trainer == "lightning":
        return [script, "--max-steps", str(a.steps), "--devices", str(devices), "--num-nodes", str(nodes),
                "--root", str(root / "lightning")]
    return [script, "--steps", str(a.steps), "--interval", str(max(1, a.interval_steps)), "--root", str(root / "torchtitan")]
