"""Snapshot strategies measured like with like (issue 45, item 1): the one timing loop that
``bench/memory_tier.py`` runs every strategy through, in one job.

Each mode is the same training loop at the same interval; only what is done at a due step
differs. The modes run in blocks of ``block`` steps whose order rotates each round (round 0 is
warm-up); each guard's background work is drained after its block, so none spills into another
mode's block. Per mode and per rank it records:

* the wall-clock time of each step (train + guard + a barrier: the slowest rank's step), from
  which the overhead is the median over rounds of each round's ratio of mean step times to that
  round's no-snapshot blocks (means: a block's few snapshot steps are its long ones) (this shared 2-core VM drifts within a minute; adjacent blocks see the
  same load);
* the **stall**: ``guard.step()`` at a due step (what holds the training thread, whatever the
  strategy does there: copy, stage, wait for the previous write, write);
* **background CPU-seconds**: the process's CPU time (every thread) minus the training
  thread's, from the block's start until its background work was drained, less the same rate
  of the no-snapshot blocks (gloo's own threads run there too). That is the work a strategy
  moves off the training thread: the replica copy, DCP's background write, their gloo and
  zlib threads. On this 2-core VM with 4 ranks it competes with the training for the cores;
  on a GPU node's host (tens of idle cores) it mostly does not: the goodput simulator takes
  that term separately (``docs/goodput.md``).

The per-snapshot wall-clock cost is the overhead fraction x the no-snapshot step x the steps
per snapshot taken.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Mode:
    """One strategy: ``memory`` every K steps (0: off), a disk snapshot every ``disk`` steps
    (0: off; ``sync``: blocking dcp.save instead of async), or a plain copy every step."""

    name: str
    label: str
    memory: int = 0
    disk: int = 0
    sync: bool = False
    memcpy: bool = False
    guard: bool = False  # a guard that snapshots nothing (its per-step agreement only)
    budget: float = 0.0  # the memory tier's replica budget (SENTINEL_MEMORY_REPLICA_BUDGET)

    @property
    def every(self) -> int:
        """Steps between due steps (a step where something is snapshot); 0: never."""
        periods = [p for p in (self.memory, self.disk) if p > 0] + ([1] if self.memcpy else [])
        return min(periods) if periods else 0


def modes(interval: int, budget: float = 0.05) -> tuple[Mode, ...]:
    """The strategies compared: every one of the interval-``interval`` rows at that interval."""
    i = interval
    return (
        Mode("none", "no snapshots"),
        Mode("guard", "guard only (no snapshot due)", guard=True),
        Mode("memcpy", "plain copy every step (memcpy)", memcpy=True),
        Mode("memory_k1", "memory tier every step (K = 1)", memory=1),
        Mode("memory_k1_budget", f"K = 1, replica budget {budget:.0%}", memory=1, budget=budget),
        Mode("memory_k1_disk", f"memory tier K = 1 + disk every {2 * i}", memory=1, disk=2 * i),
        Mode("memory", f"memory tier every {i}", memory=i),
        Mode("async", f"async DCP to disk every {i}", disk=i),
        Mode("sync", f"blocking dcp.save every {i}", disk=i, sync=True),
    )


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def median_ci95(xs: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95 % confidence interval of the median of ``xs`` (order statistics: the
    median lies between the j-th smallest and the j-th largest with probability >= 95 %, j from the
    binomial(n, 1/2)); None under 6 values, where no such pair exists."""
    n = len(xs)
    tail, j = 0.0, 0
    while tail + math.comb(n, j) / 2 ** n <= 0.025:
        tail += math.comb(n, j) / 2 ** n
        j += 1
    if j == 0:
        return None
    ordered = sorted(xs)
    return ordered[j - 1], ordered[n - j]


def make_guards(selected: tuple[Mode, ...], make_state: Callable[[], dict], snapdir: Path, holder: Path, node: str,
                run_id: str) -> dict[str, Any]:
    import os

    from trainer.guard import SnapshotGuard
    from trainer.memory.tier import BUDGET_ENV

    guards = {}
    for m in selected:
        if m.memory:
            os.environ[BUDGET_ENV] = str(m.budget)
            guards[m.name] = SnapshotGuard(snapdir / m.name, make_state(), memory_interval_steps=m.memory,
                                           interval_steps=m.disk, keep=1, memory_dir=holder / m.name / node,
                                           memory_run_id=f"{run_id}-{m.name}")
            os.environ.pop(BUDGET_ENV)
        elif m.disk or m.guard:
            guards[m.name] = SnapshotGuard(snapdir / m.name, make_state(), interval_steps=m.disk, keep=1,
                                           async_save=not m.sync)
    return guards


def run_blocks(selected: tuple[Mode, ...], guards: dict[str, Any], rounds: int, block: int,
               train_step: Callable[[int], None], shard: Callable[[], list[torch.Tensor]]) -> dict[str, Any]:
    """The interleaved blocks; this rank's raw figures per mode (round 0 left out)."""
    rec = {m.name: {"times": [], "rounds": {}, "stalls": [], "bg": 0.0, "main": 0.0, "steps": 0, "due": 0}
           for m in selected}
    warm: dict[str, tuple[int, int, int]] = {}
    counters = {m.name: 0 for m in selected}
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    step = 0
    order = list(selected)
    for r in range(rounds):
        if r == 1:  # round 0 is the warm-up: its snapshots are not counted
            warm = {n: (g.memory.late, len(g.memory.replicator.seconds), _skipped(g)) for n, g in guards.items()
                    if g.memory is not None}
        for m in order[r % len(order):] + order[:r % len(order)]:
            g, mine = guards.get(m.name), rec[m.name]
            c0, p0 = time.thread_time(), time.process_time()
            for _ in range(block):
                t0 = time.perf_counter()
                train_step(step)
                due = m.every > 0 and (counters[m.name] + 1) % m.every == 0
                s0 = time.perf_counter()
                if m.memcpy:
                    if not src:  # once: the optimizer state exists after the first step
                        src = shard()
                        dst = [torch.empty_like(t) for t in src]
                    for d, s in zip(dst, src):
                        d.copy_(s)
                elif g is not None:
                    late = g.memory.late if g.memory is not None else 0
                    g.step(counters[m.name])
                    due = due and (g.memory is None or g.memory.late == late)  # a late one took nothing
                stalled = time.perf_counter() - s0
                counters[m.name] += 1
                dist.barrier()  # one step = the slowest rank's step
                if r > 0:
                    took = time.perf_counter() - t0
                    mine["times"].append(took)
                    mine["rounds"].setdefault(r, []).append(took)
                    mine["steps"] += 1
                    if due:
                        mine["stalls"].append(stalled)
                    if m.every > 0 and (counters[m.name]) % m.every == 0:
                        mine["due"] += 1
                step += 1
            if g is not None:
                g.drain()  # its background work ends inside its own CPU accounting
            if r > 0:
                main = time.thread_time() - c0
                mine["main"] += main
                mine["bg"] += time.process_time() - p0 - main
            dist.barrier()
    for name, g in guards.items():
        if g.memory is not None:
            late, copies, skipped = warm.get(name, (0, 0, 0))
            rec[name]["late"] = g.memory.late - late
            rec[name]["replicas"] = len(g.memory.replicator.seconds) - copies
            rec[name]["replica_seconds"] = g.memory.replicator.seconds[copies:]
            rec[name]["replica_skipped"] = _skipped(g) - skipped
            rec[name]["summary"] = g.memory_summary()
    return rec


def _skipped(guard: Any) -> int:
    return int(getattr(guard.memory, "replica_skipped", 0))


def combine(selected: tuple[Mode, ...], everyone: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: every rank's raw figures into one row per mode."""
    world = len(everyone)
    none = everyone[0]["none"]
    rounds = sorted(none["rounds"])
    base = statistics.fmean(none["times"])
    bg_rate = statistics.fmean(e["none"]["bg"] / max(1, e["none"]["steps"]) for e in everyone)
    main_rate = statistics.fmean(e["none"]["main"] / max(1, e["none"]["steps"]) for e in everyone)
    rows = {}
    for m in selected:
        mine = everyone[0][m.name]
        # means, not medians: a block's snapshot steps are its few long ones
        ratios = sorted(statistics.fmean(mine["rounds"][r]) / statistics.fmean(none["rounds"][r]) for r in rounds)
        late = mine.get("late", 0)
        taken = max(0, mine["due"] - late) if m.every else 0
        per = mine["steps"] / taken if taken else None  # steps per snapshot taken
        bg = statistics.fmean(e[m.name]["bg"] / max(1, e[m.name]["steps"]) for e in everyone) - bg_rate
        main = statistics.fmean(e[m.name]["main"] / max(1, e[m.name]["steps"]) for e in everyone) - main_rate
        overhead = median(ratios) - 1
        ci = median_ci95(ratios)
        rows[m.name] = {
            "step": statistics.fmean(mine["times"]), "ratios": ratios, "overhead": overhead,
            "overhead_ci95": None if ci is None else (ci[0] - 1, ci[1] - 1),
            "snapshots": taken, "late": late, "steps": mine["steps"],
            "stall": median([s for e in everyone for s in e[m.name]["stalls"]]),
            "cost": overhead * base * per if per else None,  # wall-clock seconds per snapshot
            "background_cpu": bg * per if per else None,  # CPU-seconds per snapshot, per rank
            "training_cpu": main * per if per else None,
            "replicas": sum(e[m.name].get("replicas", 0) for e in everyone) // world,
            "replica_skipped": sum(e[m.name].get("replica_skipped", 0) for e in everyone) // world,
            "replica_seconds": median([x for e in everyone for x in e[m.name].get("replica_seconds", [])]),
            "summary": mine.get("summary"),
        }
    return {"base": base, "rows": rows}


def contention(rows: dict[str, Any]) -> float | None:
    """What one CPU-second of background work cost the step in wall-clock seconds on this machine:
    (per-snapshot wall cost - stall) / background CPU, the median over the strategies that moved
    at least 1 ms of CPU per snapshot off the training thread."""
    xs = [(r["cost"] - r["stall"]) / r["background_cpu"] for n, r in rows.items()
          if n not in ("none", "memcpy", "guard") and r["cost"] is not None and r["stall"] is not None
          and r["background_cpu"] is not None and r["background_cpu"] > 1e-3]
    return median(xs)


def print_rows(title: str, res: dict[str, Any], selected: tuple[Mode, ...]) -> None:
    print(title)
    print(f"  {'mode':<40} {'step ms':>8} {'vs none':>8} {'(rounds)':>13} {'(95 % CI)':>14} {'stall ms':>9} "
          f"{'bg CPU ms':>10} "
          f"{'cost ms':>8} {'taken':>6} {'late':>5} {'replicas':>9}")
    for m in selected:
        r = res["rows"][m.name]
        spread = f"{(r['ratios'][0] - 1) * 100:+.0f}..{(r['ratios'][-1] - 1) * 100:+.0f}%"
        ci = "" if r["overhead_ci95"] is None else "{:+.1f}..{:+.1f}%".format(*(x * 100 for x in r["overhead_ci95"]))

        def ms(x: float | None) -> str:
            return "" if x is None else f"{x * 1e3:.2f}"
        reps = f"{r['replicas']} (-{r['replica_skipped']})" if m.memory else ""
        print(f"  {m.label:<40} {r['step'] * 1e3:>8.2f} {r['overhead'] * 100:>+7.1f}% {spread:>13} {ci:>14} "
              f"{ms(r['stall']):>9} {ms(r['background_cpu']):>10} {ms(r['cost']):>8} {r['snapshots'] if m.every else '':>6} "
              f"{r['late'] if m.memory else '':>5} {reps:>9}")
    print("  (step: mean; vs none: median over rounds of each round's ratio of mean steps to that round's\n"
          "   no-snapshot blocks, the rounds' range and the median's 95 % confidence interval (order\n"
          "   statistics; 6 rounds or more) in parentheses; stall: guard.step() at a due step;\n"
          "   bg CPU: CPU-seconds per snapshot per rank off the\n"
          "   training thread, beyond the no-snapshot blocks'; cost: wall-clock seconds per snapshot;\n"
          "   replicas: replica rounds done (-skipped while one was in flight or the sender's budget was spent))")
