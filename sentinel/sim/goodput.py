"""Goodput at 10,000+ GPUs: a discrete-event Monte Carlo of one training job on N GPUs.

Strategies, side by side on the same failure draws (common random numbers):

* ``periodic``  — blocking checkpoint every ``interval`` hours of compute (write time ``w``);
  a failure loses the work since the last checkpoint and costs a restart ``u0``.
* ``async``     — the same, but the loop blocks only ``w_stage`` per checkpoint; a checkpoint
  counts only once its background write (``w``) has finished.
* ``sentinel``  — failures that are predictable (a per-class fraction) with a lead time long
  enough become snapshot + spare migration (``migrate`` hours paused, nothing lost); the rest
  fall back to ``async``.

Every failure takes a node from a spare pool of size S; the failed node returns after
``repair`` hours. With the pool empty the job waits for the first repaired node.

Outputs: ETTR (productive compute / wall time), lost GPU-hours by cause, and the probability the
spare pool runs dry. Validation: with prediction off, ETTR matches Meta's closed form
E[ETTR] ~ (1 - N_nodes r_f (u0 + dt/2)) / (1 + w/dt); the best interval matches Young/Daly
sqrt(2 w / (N_nodes r_f)) (tests/test_goodput.py).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass, field, replace

# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs
# (Dubey et al. 2024, Table 5). (class, count, predictable fraction — Sentinel's conservative
# assumption of how many a health signal precedes by minutes; see docs/goodput.md)
LLAMA3_CLASSES: tuple[tuple[str, int, float], ...] = (
    ("faulty_gpu", 148, 0.25),
    ("gpu_hbm3_memory", 72, 0.50),
    ("software_bug", 54, 0.0),
    ("network_switch_cable", 35, 0.0),
    ("host_maintenance", 32, 0.0),
    ("gpu_sram_memory", 19, 0.30),
    ("gpu_system_processor", 17, 0.10),
    ("nic", 7, 0.0),
    ("nccl_watchdog_timeout", 7, 0.0),
    ("silent_data_corruption", 6, 0.0),
    ("gpu_thermal", 6, 0.50),
    ("ssd", 3, 0.0),
    ("power_supply", 3, 0.0),
    ("server_chassis", 2, 0.0),
    ("io_expansion_board", 2, 0.0),
    ("dependency", 2, 0.0),
    ("cpu", 2, 0.0),
    ("system_memory", 2, 0.10),
)
LLAMA3_RATE = 419 / (16384 / 8) / 54  # failures per node-day = 3.79 per 1,000 node-days
PRESETS = {
    "llama3": LLAMA3_RATE,
    "rsc1": 6.50 / 1000,  # Meta RSC-1 (Kokolis et al. 2024, "Revisiting Reliability in Large-Scale ML Research Clusters")
    "rsc2": 2.34 / 1000,  # Meta RSC-2
}
STRATEGIES = ("periodic", "async", "sentinel")


@dataclass(frozen=True)
class Params:
    gpus: int = 16384
    gpus_per_node: int = 8
    days: float = 30.0
    rate_per_node_day: float = LLAMA3_RATE
    classes: tuple[tuple[str, int, float], ...] = LLAMA3_CLASSES
    interval_hours: float = 0.5  # compute between checkpoints
    write_hours: float = 5 / 60  # w: checkpoint write time
    stage_hours: float = 10 / 3600  # async: blocked while staging
    restart_hours: float = 15 / 60  # u0: restart overhead after a failure
    migrate_hours: float = 2 / 60  # Sentinel: snapshot + drain + spare admission
    lead_mean_hours: float = 0.5  # mean lead time of a predictable failure (exponential)
    min_lead_hours: float = 2 / 60  # a shorter warning is useless (it falls back to async)
    spares: int | None = None  # None: unlimited
    repair_hours: float = 72.0
    prediction: bool = True

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def failures_per_hour(self) -> float:
        return self.nodes * self.rate_per_node_day / 24.0


@dataclass(frozen=True)
class Failure:
    time: float
    cls: str
    predictable: bool
    lead: float


@dataclass
class Outcome:
    ettr: float
    lost_gpu_hours: dict[str, float] = field(default_factory=dict)
    waited_for_spare: bool = False
    failures: int = 0
    migrations: int = 0


def draw_failures(p: Params, rng: random.Random) -> list[Failure]:
    horizon = p.days * 24.0
    names = [c[0] for c in p.classes]
    weights = [c[1] for c in p.classes]
    predictable = {c[0]: c[2] for c in p.classes}
    out, t = [], 0.0
    rate = p.failures_per_hour
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            return out
        cls = rng.choices(names, weights)[0]
        pred = rng.random() < predictable[cls]
        lead = rng.expovariate(1.0 / p.lead_mean_hours) if p.lead_mean_hours > 0 else 0.0
        out.append(Failure(t, cls, pred, lead))


class SparePool:
    def __init__(self, size: int | None, repair: float) -> None:
        self.free = math.inf if size is None else size
        self.repair = repair
        self.returns: list[float] = []

    def take(self, t: float) -> float:
        """Take a spare at time t; returns when one is available (t, or a repair's return)."""
        heapq.heappush(self.returns, t + self.repair)  # the failed node goes to repair
        while self.returns and self.returns[0] <= t:
            heapq.heappop(self.returns)
            self.free += 1
        ready = t
        if self.free < 1:
            ready = heapq.heappop(self.returns)  # wait for the first repaired node
            self.free += 1
        self.free -= 1
        return ready


def simulate(p: Params, strategy: str, failures: list[Failure]) -> Outcome:
    """One run of one strategy over pre-drawn failures."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    horizon = p.days * 24.0
    dt = p.interval_hours
    block = p.write_hours if strategy == "periodic" else p.stage_hours
    durable_delay = 0.0 if strategy == "periodic" else max(0.0, p.write_hours - p.stage_hours)
    cycle = dt + block
    pool = SparePool(p.spares, p.repair_hours)
    out = Outcome(ettr=0.0, failures=len(failures))
    lost: dict[str, float] = {}
    start, committed = 0.0, 0.0  # segment start (wall), progress committed (compute hours)

    def progress_at(t: float) -> float:
        """Compute done since `start`, at wall time t (checkpoint pauses excluded)."""
        if t <= start:
            return 0.0
        k, rem = divmod(t - start, cycle)
        return k * dt + min(rem, dt)

    def durable_at(t: float) -> float:
        """Compute covered by the last checkpoint durable at time t."""
        if t <= start:
            return 0.0
        k = math.floor((t - start - durable_delay) / cycle) if t - start >= durable_delay else 0
        return max(0, k) * dt

    for f in failures:
        if f.time < start:  # failed while the job was restarting: the restart simply continues
            continue
        gpu_h = p.gpus  # while the job is down or redoing work, every GPU of it is idle
        use_sentinel = (strategy == "sentinel" and p.prediction and f.predictable and f.lead >= p.min_lead_hours
                        and f.time - f.lead >= start)
        if use_sentinel:
            t_snap = f.time - f.lead
            committed += progress_at(t_snap)
            ready = pool.take(t_snap)
            out.waited_for_spare |= ready > t_snap
            start = max(t_snap + p.migrate_hours, ready + p.migrate_hours)
            lost["migration"] = lost.get("migration", 0.0) + (start - t_snap) * gpu_h
            out.migrations += 1
            continue
        done = progress_at(f.time)
        saved = durable_at(f.time)
        committed += saved
        ready = pool.take(f.time)
        out.waited_for_spare |= ready > f.time
        restart_at = max(f.time, ready) + p.restart_hours
        lost[f.cls] = lost.get(f.cls, 0.0) + ((done - saved) + (restart_at - f.time)) * gpu_h
        start = restart_at
    committed += progress_at(horizon) if horizon > start else 0.0
    out.ettr = committed / horizon
    # what remains of (1 - ETTR) is time blocked writing or staging checkpoints
    lost["checkpoint_overhead"] = max(0.0, (horizon - committed) * p.gpus - sum(lost.values()))
    out.lost_gpu_hours = lost
    return out


@dataclass
class Summary:
    strategy: str
    ettr_mean: float
    ettr_p5: float
    lost_gpu_hours: dict[str, float]
    spare_exhaustion: float
    failures_mean: float
    migrations_mean: float


def run(p: Params, runs: int = 200, seed: int = 0, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Summary]:
    rng = random.Random(seed)
    draws = [draw_failures(p, rng) for _ in range(runs)]
    out = {}
    for s in strategies:
        outs = [simulate(p, s, d) for d in draws]
        ettrs = sorted(o.ettr for o in outs)
        lost: dict[str, float] = {}
        for o in outs:
            for k, v in o.lost_gpu_hours.items():
                lost[k] = lost.get(k, 0.0) + v / runs
        out[s] = Summary(s, statistics.fmean(ettrs), ettrs[int(0.05 * len(ettrs))], lost,
                         sum(o.waited_for_spare for o in outs) / runs, statistics.fmean(o.failures for o in outs),
                         statistics.fmean(o.migrations for o in outs))
    return out


def closed_form_ettr(p: Params) -> float:
    """Meta's expected ETTR for periodic checkpointing (Kokolis et al. 2024)."""
    lam = p.failures_per_hour
    return (1 - lam * (p.restart_hours + p.interval_hours / 2)) / (1 + p.write_hours / p.interval_hours)


def young_daly(p: Params) -> float:
    return math.sqrt(2 * p.write_hours / p.failures_per_hour)


def min_spares(p: Params, target: float = 0.01, runs: int = 200, seed: int = 0, strategy: str = "sentinel") -> int:
    """Smallest spare pool whose exhaustion probability is below `target`."""
    rng = random.Random(seed)
    draws = [draw_failures(p, rng) for _ in range(runs)]

    def dry(s: int) -> float:
        q = replace(p, spares=s)
        return sum(simulate(q, strategy, d).waited_for_spare for d in draws) / runs

    hi = 1
    while dry(hi) >= target:  # exhaustion only falls as the pool grows: gallop, then bisect
        hi *= 2
        if hi > 1_000_000:
            return -1
    lo = 0 if dry(0) >= target else -1
    if lo < 0:
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if dry(mid) < target:
            hi = mid
        else:
            lo = mid
    return hi


def table(results: dict[str, Summary], p: Params) -> str:
    lines = [f"{p.gpus:,} GPUs ({p.nodes:,} nodes), {p.days:g} days, {p.rate_per_node_day * 1000:.2f} failures / 1,000 node-days, "
             f"interval {p.interval_hours * 60:.0f} min, write {p.write_hours * 60:.1f} min, restart {p.restart_hours * 60:.0f} min, "
             f"spares {'unlimited' if p.spares is None else p.spares}",
             f"{'strategy':<10} {'ETTR':>7} {'p5 ETTR':>8} {'lost GPU-h':>11} {'failures':>9} {'migrations':>11} {'P(spares dry)':>14}"]
    for s in results.values():
        lines.append(f"{s.strategy:<10} {s.ettr_mean:>7.4f} {s.ettr_p5:>8.4f} {sum(s.lost_gpu_hours.values()):>11,.0f} "
                     f"{s.failures_mean:>9.1f} {s.migrations_mean:>11.1f} {s.spare_exhaustion:>14.3f}")
    top = sorted(results["periodic"].lost_gpu_hours.items(), key=lambda kv: -kv[1])[:5]
    lines.append("largest causes of lost GPU-hours (periodic): " + ", ".join(f"{k} {v:,.0f}" for k, v in top))
    return "\n".join(lines)


def plot(path: str, base: Params, runs: int, seed: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install 'sentinel-gpu[plot]'") from None
    sizes = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000]
    curves: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for n in sizes:
        res = run(replace(base, gpus=n), runs=runs, seed=seed)
        for s in STRATEGIES:
            curves[s].append(res[s].ettr_mean)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, ys in curves.items():
        ax.plot(sizes, ys, marker="o", label=s)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (productive / wall time)")
    ax.set_title(f"ETTR vs scale ({base.days:g} days, {base.rate_per_node_day * 1000:.2f} failures/1k node-days)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3", help="failure rate preset")
    ap.add_argument("--interval-minutes", type=float, default=30.0)
    ap.add_argument("--write-minutes", type=float, default=5.0)
    ap.add_argument("--restart-minutes", type=float, default=15.0)
    ap.add_argument("--migrate-minutes", type=float, default=2.0)
    ap.add_argument("--lead-mean-minutes", type=float, default=30.0)
    ap.add_argument("--spares", type=int, default=None, help="spare nodes (default: unlimited)")
    ap.add_argument("--repair-hours", type=float, default=72.0)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prediction", action="store_true")
    ap.add_argument("--size-spares", action="store_true", help="find the pool size keeping P(dry) < 1 %%")
    ap.add_argument("--plot", metavar="PNG", help="also plot ETTR vs N (1k..100k GPUs); needs matplotlib")


def params_from(args: argparse.Namespace) -> Params:
    return Params(gpus=args.gpus, days=args.days, rate_per_node_day=PRESETS[args.preset],
                  interval_hours=args.interval_minutes / 60, write_hours=args.write_minutes / 60,
                  restart_hours=args.restart_minutes / 60, migrate_hours=args.migrate_minutes / 60,
                  lead_mean_hours=args.lead_mean_minutes / 60, spares=args.spares, repair_hours=args.repair_hours,
                  prediction=not args.no_prediction)


def main_args(args: argparse.Namespace) -> int:
    p = params_from(args)
    print(table(run(p, runs=args.runs, seed=args.seed), p))
    print(f"closed-form periodic ETTR: {closed_form_ettr(p):.4f}; Young/Daly interval: {young_daly(p) * 60:.1f} min")
    if args.size_spares:
        for s in STRATEGIES:
            print(f"spares for P(pool dry) < 1 % ({s}): {min_spares(p, runs=args.runs, seed=args.seed, strategy=s)}")
    if args.plot:
        plot(args.plot, p, runs=max(20, args.runs // 4), seed=args.seed)
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sentinel simulate goodput")
    add_arguments(ap)
    return main_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
