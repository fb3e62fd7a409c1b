"""Torch's flight recorder as the progress exchange reads it: whether it is on, this rank's dump,
the name a group has there, and the pure split of each step into compute and waiting (see
:mod:`trainer.progress`, which re-exports these names)."""

from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Any, Mapping

import torch.distributed as dist

log = logging.getLogger("sentinel.trainer.progress")


def flight_recorder_on() -> bool:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        v = os.environ.get(name, "")
        if v.isdigit() and int(v) > 0:
            return True
    return False


def dump_flight_recorder() -> dict[str, Any] | None:
    """This rank's flight recorder dump (parsed JSON), or None when it is off or unavailable."""
    if not flight_recorder_on():
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return None
    try:  # torch's own bytes from this process; no stack traces (about 0.2 ms for 64 entries)
        return pickle.loads(_dump_fr_trace(True, False, False))
    except (RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        log.debug("flight recorder dump failed: %s", exc)
        return None


def group_key(group: Any) -> str:
    """The name the flight recorder gives ``group`` (``default_pg``, or its pg id)."""
    if group is None:
        return "default_pg"
    try:
        name = dist.distributed_c10d._get_process_group_name(group)
    except (AttributeError, RuntimeError, ValueError):
        return ""
    return name


FR_SLOTS = 64  # collectives per group per window whose entry times the ranks compare
FR_GROUPS = 8  # groups compared (by pg id modulo this)


def window_entries(boundaries: list[tuple[int, int, bool]], traces: Mapping[str, Any],
                   exclude: set[str] = frozenset()) -> dict[int, int]:
    """Pure: slot -> entry wall ns of each collective this rank entered within the window (after
    the first step boundary, up to the last), from :func:`sentinel.hang.parse_flight_recorder`'s
    traces. A slot is ``(pg id % FR_GROUPS) * FR_SLOTS + seq % FR_SLOTS``: the same collective has
    the same slot on every rank (the last FR_SLOTS of each group in the window)."""
    if len(boundaries) < 2:
        return {}
    lo, hi = boundaries[0][1], boundaries[-1][1]
    out: dict[int, int] = {}
    for name, t in traces.items():
        if name in exclude or not str(t.pg_id).isdigit():
            continue
        seqs = sorted(q for q, ns in t.created_ns.items() if lo < ns <= hi)[-FR_SLOTS:]
        for q in seqs:
            out[(int(t.pg_id) % FR_GROUPS) * FR_SLOTS + q % FR_SLOTS] = t.created_ns[q]
    return out


def split_steps(boundaries: list[tuple[int, int, bool]], mine: Mapping[int, int],
                latest: Mapping[int, float]) -> list[tuple[int, float, float, bool]]:
    """Pure: (step, step seconds, compute seconds, snapshot) per step, from the step boundaries
    ``(step, wall ns at the end of that step, snapshot)`` in order, this rank's collective entry
    times (slot -> ns, :func:`window_entries`) and the latest entry of each over the job's ranks.
    A rank waits in a collective until the last rank enters it: compute is the step time less
    those waits, so the slowest rank (whom everyone waits for) keeps its whole step, and a rank
    that waited for it does not. A step without a compared collective is left out."""
    out = []
    for (_, start, _), (step, end, snap) in zip(boundaries, boundaries[1:]):
        inside = [(ns, latest.get(slot)) for slot, ns in mine.items() if start < ns <= end]
        if not inside or end <= start:
            continue
        wait = sum(max(0.0, last - ns) for ns, last in inside if last is not None and math.isfinite(last)) / 1e9
        step_s = (end - start) / 1e9
        out.append((step, step_s, max(0.0, step_s - wait), snap))
    return out
