"""Goodput at 10,000+ GPUs: a discrete-event Monte Carlo of one training job on N GPUs.

Strategies, side by side on the same failure draws (common random numbers):

* ``periodic``  — blocking checkpoint every ``interval`` hours of compute (write time ``w``);
  a failure loses the work since the last checkpoint and costs a restart from disk.
* ``async``     — the same, but the loop blocks only while staging (``stall per GB × state``);
  a checkpoint counts only once its background write (``w``) has finished.
* ``sentinel``  — failures that are predictable (a per-class fraction) with a lead time long
  enough become snapshot + spare migration (``migrate``, nothing lost); the rest fall back to
  ``async``.
* ``sentinel_memory`` — Sentinel plus the in-memory tier: a snapshot into host memory every K
  steps (its cost: stall + background CPU x contention, per GB), replicated to a partner node, and
  persisted to disk from memory in the background, back to back. A sudden failure loses at most K
  steps and restarts from memory (a process crash: the node's own memory) or from the partner's
  replica (a lost node); when both holders of a shard are gone — the partner failed before the
  replicas were re-made, or one failure domain took both — it falls back to the newest disk
  snapshot, exactly as ``async`` does.
* ``sentinel_memory_spare`` — the same with a warm spare: migrations and node replacements skip
  the cold spare's start-up (``migrate_warm`` instead of ``migrate``).

Restart time is built from parts, each measured or assumed (``docs/goodput.md``): detection, the
job restart curve fitted over N nodes (``bench/rendezvous_scale.py``), loading the state (memory,
peer or disk; disk bounded by the shared filesystem's ceiling shared by all nodes) and an
``extra`` for what one machine cannot measure (scheduler, NCCL init at scale). The checkpoint
write time is ``state per node / min(node bandwidth, filesystem ceiling / nodes)``.

Every failure but a process crash takes a node from a spare pool of size S; the failed node
returns after ``repair`` hours. With the pool empty the job waits for the first repaired node.

Outputs: ETTR (productive compute / wall time), lost GPU-hours by cause, the probability the
spare pool runs dry, memory-tier fallbacks. Validation: with prediction off, ETTR matches Meta's
closed form; the best interval matches Young/Daly; Llama 3's > 90 % effective training time
(tests/test_goodput.py).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass, field, fields, replace

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
# The node survives these (its host memory too): the workers restart in place, from own memory.
PROCESS_CLASSES = frozenset({"software_bug", "nccl_watchdog_timeout", "dependency"})
# These take a whole failure domain (a rack's switch or power): every node in it at once.
DOMAIN_CLASSES = frozenset({"network_switch_cable", "power_supply"})
LLAMA3_RATE = 419 / (16384 / 8) / 54  # failures per node-day = 3.79 per 1,000 node-days
LLAMA3_ALL_INTERRUPTIONS = 466  # 419 unexpected + 47 planned, same 54 days
PRESETS = {
    "llama3": LLAMA3_RATE,
    "rsc1": 6.50 / 1000,  # Meta RSC-1 (Kokolis et al. 2024, "Revisiting Reliability in Large-Scale ML Research Clusters")
    "rsc2": 2.34 / 1000,  # Meta RSC-2
}
STRATEGIES = ("periodic", "async", "sentinel", "sentinel_memory", "sentinel_memory_spare")
MEMORY_STRATEGIES = frozenset({"sentinel_memory", "sentinel_memory_spare"})
LABELS = {
    "periodic": "periodic disk checkpoint + restart",
    "async": "async disk snapshots + restart",
    "sentinel": "Sentinel (predicted -> migrate, else async)",
    "sentinel_memory": "Sentinel + memory tier",
    "sentinel_memory_spare": "Sentinel + memory tier + warm spare",
}
PLACEMENTS = ("cross_domain", "adjacent")
H = 3600.0  # seconds per hour


@dataclass(frozen=True)
class Params:
    """One job and its inputs. Times are hours unless the name says seconds."""

    gpus: int = 16384
    gpus_per_node: int = 8
    days: float = 30.0
    rate_per_node_day: float = LLAMA3_RATE
    classes: tuple[tuple[str, int, float], ...] = LLAMA3_CLASSES
    # intervals (optimised by optimise_intervals)
    interval_hours: float = 0.5  # disk strategies: compute between checkpoints
    memory_interval_steps: int = 1  # memory strategies: K
    step_seconds: float = 6.0
    # checkpoint size and storage
    state_gb_per_gpu: float = 0.4
    node_write_gbps: float = 5.0
    fs_ceiling_gbps: float = 2000.0
    stall_seconds_per_gb: float = 0.25  # async: blocked while staging one GB of state per rank
    write_hours: float | None = None  # None: from the bandwidth model
    stage_hours: float | None = None  # None: stall_seconds_per_gb x state_gb_per_gpu
    # restart: detect + curve(nodes) + load state + extra
    detect_seconds: float = 1.0
    restart_curve: tuple[str, float, float] = ("log2", 10.0, 0.0)  # (form, a, b): a + b*f(nodes) seconds
    restart_extra_seconds: float = 120.0
    restore_memory_seconds: float = 2.0
    restore_peer_seconds: float = 5.0
    restore_disk_seconds: float = 0.0  # measured load from disk on one node; the bandwidth term is added
    restart_hours: float | None = None  # None: from the parts above (the restart from disk)
    # Sentinel
    migrate_seconds: float = 120.0
    migrate_warm_seconds: float = 3.0
    curve_nodes_measured: int = 2  # the job size the migrate figures were measured at
    lead_mean_hours: float = 0.5  # mean lead time of a predictable failure (exponential)
    min_lead_hours: float = 2 / 60  # a shorter warning is useless (it falls back to async)
    prediction: bool = True
    # memory tier: a snapshot costs the step its stall plus the wall-clock share of its background CPU
    # (bench/memory_tier.py measures both per GB, like for like with the async disk snapshot's)
    memory_stall_seconds_per_gb: float = 0.25
    memory_cpu_seconds_per_gb: float = 0.0  # background: CRC32, the replica send and receive
    memory_overhead_fraction: float | None = None  # typed: a memory snapshot's whole cost as a share of a step
    # wall-clock seconds one CPU-second of a snapshot's background work costs the step. A GPU node's host
    # has tens of cores idle beside its 8 training processes (NVIDIA DGX H100: 2 x 56-core Xeon 8480C,
    # DGX H100 User Guide, "Hardware Overview"), so 0 there; bench/memory_tier.py measures this 2-core VM's
    # (reference_contention_ratio), where 4 ranks and the background share 2 cores
    background_contention: float = 0.0
    async_cpu_seconds_per_gb: float = 0.0  # async disk: DCP's background serialisation and write
    placement: str = "cross_domain"
    domain_nodes: int = 2
    # spares
    spares: int | None = None  # None: unlimited
    repair_hours: float = 72.0
    # circuit breaker (sentinel/backends/breaker.py; its defaults)
    breaker_max_fraction: float = 0.5
    breaker_window_seconds: float = 300.0
    breaker_nodes: int | None = None  # the partition the breaker counts (None: the job's nodes + spares)

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, not {self.placement!r}")
        if self.restart_curve[0] not in CURVES:
            raise ValueError(f"restart curve form must be one of {sorted(CURVES)}, not {self.restart_curve[0]!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (not math.isfinite(v) or v < 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, not {v!r}")
        if self.gpus < 1 or self.gpus_per_node < 1 or self.memory_interval_steps < 1 or self.domain_nodes < 1:
            raise ValueError("gpus, gpus_per_node, memory_interval_steps and domain_nodes must be >= 1")
        if self.interval_hours <= 0 or self.step_seconds <= 0 or self.days <= 0:
            raise ValueError("interval_hours, step_seconds and days must be > 0")
        if not 0 < self.breaker_max_fraction <= 1:
            raise ValueError(f"breaker_max_fraction must be in (0, 1], not {self.breaker_max_fraction!r}")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def failures_per_hour(self) -> float:
        return self.nodes * self.rate_per_node_day / 24.0

    # -- derived times (hours) --------------------------------------------------------------------
    def fs_gbps_per_node(self) -> float:
        """What one node gets from the shared filesystem while every node writes (or reads) at once."""
        return min(self.node_write_gbps, self.fs_ceiling_gbps / self.nodes) if self.node_write_gbps > 0 else 0.0

    def write_h(self) -> float:
        if self.write_hours is not None:
            return self.write_hours
        bw = self.fs_gbps_per_node()
        return self.state_gb_per_gpu * self.gpus_per_node / bw / H if bw > 0 else math.inf

    def stage_h(self) -> float:
        """What one async disk snapshot costs the loop: its stall plus its background CPU's share."""
        if self.stage_hours is not None:
            return self.stage_hours
        per_gb = self.stall_seconds_per_gb + self.background_contention * self.async_cpu_seconds_per_gb
        return per_gb * self.state_gb_per_gpu / H

    def memory_block_h(self) -> float:
        """What one memory snapshot costs the loop, measured the same way as :meth:`stage_h`."""
        if self.memory_overhead_fraction is not None:
            return self.memory_overhead_fraction * self.step_seconds / H
        per_gb = self.memory_stall_seconds_per_gb + self.background_contention * self.memory_cpu_seconds_per_gb
        return per_gb * self.state_gb_per_gpu / H

    def curve_seconds(self, nodes: int) -> float:
        """The rendezvous protocol of a replacement at ``nodes``: measured (``power``: a * N^b,
        bench/replacement_scale.py), or a typed/default ``linear``/``log2`` a + b * f(N)."""
        form, a, b = self.restart_curve
        if form == "power":
            return max(0.0, a * max(1, nodes) ** b)
        return max(0.0, a + b * CURVES[form](nodes))

    def restore_disk_h(self) -> float:
        bw = self.fs_gbps_per_node()
        load = self.state_gb_per_gpu * self.gpus_per_node / bw if bw > 0 else math.inf
        return max(self.restore_disk_seconds, load) / H

    def restart_h(self, source: str = "disk", warm: bool = False) -> float:
        """Failure -> stepping again, restoring from ``source`` (disk, memory or peer)."""
        restore = {"disk": self.restore_disk_h(), "memory": self.restore_memory_seconds / H,
                   "peer": self.restore_peer_seconds / H}[source]
        if self.restart_hours is not None:
            base = self.restart_hours - self.restore_disk_h()
        else:
            base = (self.detect_seconds + self.curve_seconds(self.nodes) + self.restart_extra_seconds) / H
        if warm and source != "memory":  # a node was replaced: a warm spare skips its cold start
            base -= max(0.0, self.migrate_seconds - self.migrate_warm_seconds) / H
        return max(self.detect_seconds / H, base + restore)

    def migrate_h(self, warm: bool = False) -> float:
        """Predicted failure: snapshot + drain + spare admitted + first step, grown to this job's size."""
        measured = self.migrate_warm_seconds if warm else self.migrate_seconds
        growth = self.curve_seconds(self.nodes) - self.curve_seconds(self.curve_nodes_measured)
        return max(measured, measured + growth) / H


CURVES = {"linear": float, "log2": lambda n: math.log2(max(1, n)), "power": None}


@dataclass(frozen=True)
class Failure:
    time: float
    cls: str
    predictable: bool
    lead: float
    node: int
    # trace replay (sentinel_tools.sim.trace): "sudden" | "process" from the class table; "" derives
    # it from ``cls`` (the Poisson draws, whose class names are LLAMA3_CLASSES')
    kind: str = ""
    # trace replay: when the node that replaces this one is free (None: the SparePool model)
    spare_ready: float | None = None

    @property
    def process(self) -> bool:
        """The node survives (its host memory too): the workers restart in place."""
        return self.kind == "process" if self.kind else self.cls in PROCESS_CLASSES

    @property
    def domain(self) -> bool:
        """A whole failure domain at once (a trace lists each of its nodes instead)."""
        return False if self.kind else self.cls in DOMAIN_CLASSES


@dataclass
class Outcome:
    ettr: float
    lost_gpu_hours: dict[str, float] = field(default_factory=dict)
    waited_for_spare: bool = False
    failures: int = 0
    migrations: int = 0
    fallbacks: int = 0  # memory tier: restarts that had to load from disk
    breaker_refusals: int = 0  # predicted failures the circuit breaker did not let Sentinel drain


def draw_failures(p: Params, rng: random.Random) -> list[Failure]:
    horizon = p.days * 24.0
    names = [c[0] for c in p.classes]
    cum = []
    total = 0
    for c in p.classes:
        total += c[1]
        cum.append(total)
    predictable = {c[0]: c[2] for c in p.classes}
    out, t = [], 0.0
    rate = p.failures_per_hour
    nodes = p.nodes
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            return out
        cls = names[_bisect(cum, rng.random() * total)]
        pred = rng.random() < predictable[cls]
        lead = rng.expovariate(1.0 / p.lead_mean_hours) if p.lead_mean_hours > 0 else 0.0
        out.append(Failure(t, cls, pred, lead, rng.randrange(nodes)))


def _bisect(cum: list[int], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] > x:
            hi = mid
        else:
            lo = mid + 1
    return lo


class SparePool:
    def __init__(self, size: int | None, repair: float) -> None:
        self.free = math.inf if size is None else size
        self.repair = repair
        self.returns: list[float] = []

    def take(self, t: float, count: int = 1) -> float:
        """Take ``count`` spares at time t; returns when they are available (t, or repairs' return)."""
        ready = t
        for _ in range(count):
            heapq.heappush(self.returns, t + self.repair)  # the failed node goes to repair
            while self.returns and self.returns[0] <= t:
                heapq.heappop(self.returns)
                self.free += 1
            if self.free < 1:
                ready = max(ready, heapq.heappop(self.returns))  # wait for the first repaired node
                self.free += 1
            self.free -= 1
        return ready


class Breaker:
    """Sentinel's fleet circuit breaker (sentinel/backends/breaker.py): a drain is refused when it
    would put more than ``breaker_max_fraction`` of the partition's nodes (the job's plus its
    spares) under a Sentinel drain made in the last ``breaker_window_seconds``."""

    def __init__(self, p: Params) -> None:
        self.fraction = p.breaker_max_fraction
        self.window = p.breaker_window_seconds / H
        self.nodes = p.breaker_nodes or p.nodes + (p.spares or 0)
        self.recent: list[float] = []

    def allow(self, t: float) -> bool:
        self.recent = [r for r in self.recent if t - self.window <= r <= t]
        if (len(self.recent) + 1) / self.nodes > self.fraction:
            return False
        self.recent.append(t)
        return True


def partner(p: Params, node: int) -> int:
    """The node holding ``node``'s memory replica: the next node (``adjacent``, as a ring of
    consecutive nodes) or the same slot in the next failure domain (``cross_domain``)."""
    step = 1 if p.placement == "adjacent" else p.domain_nodes
    return (node + step) % p.nodes


def both_holders_lost(p: Params, f: Failure) -> bool:
    """A domain-wide failure takes a shard's replica with it when the partner shares the domain."""
    if not f.domain or p.nodes < 2:
        return False
    return partner(p, f.node) // p.domain_nodes == f.node // p.domain_nodes


def simulate(p: Params, strategy: str, failures: list[Failure]) -> Outcome:
    """One run of one strategy over pre-drawn failures."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    horizon = p.days * 24.0
    memory = strategy in MEMORY_STRATEGIES
    warm = strategy == "sentinel_memory_spare"
    predict = strategy != "periodic" and strategy != "async" and p.prediction
    write = p.write_h()
    if memory:
        dt = p.memory_interval_steps * p.step_seconds / H
        block = p.memory_block_h()
        cycle = dt + block
        disk_every = max(1, math.ceil(write / cycle)) if math.isfinite(write) else 0  # back to back from memory
        durable_delay = write
    else:
        dt = p.interval_hours
        block = write if strategy == "periodic" else min(write, p.stage_h())
        cycle = dt + block
        disk_every = 1
        durable_delay = 0.0 if strategy == "periodic" else max(0.0, write - block)
    disk_cycle, disk_dt = disk_every * cycle, disk_every * dt
    restart = {"disk": p.restart_h("disk", warm), "memory": p.restart_h("memory", warm), "peer": p.restart_h("peer", warm)}
    migrate = p.migrate_h(warm)
    min_lead = p.min_lead_hours + p.detect_seconds / H
    pool = SparePool(p.spares, p.repair_hours)
    breaker = Breaker(p)
    out = Outcome(ettr=0.0, failures=len(failures))
    lost: dict[str, float] = {}
    gpu_h = p.gpus  # while the job is down or redoing work, every GPU of it is idle
    start, committed = 0.0, 0.0  # segment start (wall), progress committed (compute hours)
    # memory tier: a restart from memory in progress can still fall back to disk
    exposed: set[int] = set()  # nodes whose loss before `exposed_until` loses a shard's last copy
    exposed_until = -1.0
    rollback = 0.0  # the work that falling back to disk loses

    def progress_at(t: float) -> float:
        """Compute done since `start`, at wall time t (checkpoint pauses excluded)."""
        if t <= start:
            return 0.0
        k, rem = divmod(t - start, cycle)
        return k * dt + min(rem, dt)

    def snapshot_at(t: float) -> float:
        """Compute covered by the last memory snapshot (memory tier) or checkpoint (disk) at t."""
        if t <= start:
            return 0.0
        return math.floor((t - start) / cycle) * dt if memory else durable_at(t)

    def durable_at(t: float) -> float:
        """Compute covered by the last disk snapshot durable at time t."""
        if t - start < durable_delay or disk_every == 0:
            return 0.0
        return max(0, math.floor((t - start - durable_delay) / disk_cycle)) * disk_dt

    for f in failures:
        if f.time < start:  # failed while the job was restarting
            again = restart["peer"] if memory else restart["disk"]
            if f.spare_ready is not None and f.spare_ready > f.time and f.spare_ready + again > start:
                # trace replay: a node lost during the restart whose replacement is not free yet
                later = f.spare_ready + again
                lost[f.cls] = lost.get(f.cls, 0.0) + (later - start) * gpu_h
                out.waited_for_spare = True
                start = later
            if memory and f.time < exposed_until and f.node in exposed and not f.process:
                # the partner died before the replicas were re-made: that restart must load from disk
                committed -= rollback
                ready = f.spare_ready if f.spare_ready is not None else pool.take(f.time)
                out.waited_for_spare |= ready > f.time
                later = max(start, max(f.time, ready) + restart["disk"])
                lost["memory_fallback"] = lost.get("memory_fallback", 0.0) + (rollback + later - start) * gpu_h
                start = later
                out.fallbacks += 1
                exposed_until = -1.0
            continue
        if predict and f.predictable and f.lead >= min_lead and f.time - f.lead >= start:
            t_snap = f.time - f.lead
            committed += progress_at(t_snap)
            if not breaker.allow(t_snap):
                # refused: the ranks still snapshot (nothing before t_snap is lost), the node is not
                # drained and fails at f.time like an unpredicted one
                out.breaker_refusals += 1
                start = t_snap
                f = replace(f, predictable=False)
            else:
                ready = f.spare_ready if f.spare_ready is not None else pool.take(t_snap)
                out.waited_for_spare |= ready > t_snap
                start = max(t_snap, ready) + migrate
                lost["migration"] = lost.get("migration", 0.0) + (start - t_snap) * gpu_h
                out.migrations += 1
                continue
        done = progress_at(f.time)
        node_lost = not f.process
        source = "disk"
        if memory:
            double = node_lost and ((f.time < exposed_until and f.node in exposed) or both_holders_lost(p, f))
            source = "disk" if double else ("peer" if node_lost else "memory")
        durable = durable_at(f.time)
        saved = snapshot_at(f.time) if source != "disk" else durable
        if memory and source == "disk":
            out.fallbacks += 1
        committed += saved
        if f.spare_ready is not None:
            ready = f.spare_ready if node_lost else f.time
        else:
            ready = pool.take(f.time, (p.domain_nodes if f.domain else 1) if node_lost else 0)
        out.waited_for_spare |= ready > f.time
        restart_at = max(f.time, ready) + restart[source]
        lost[f.cls] = lost.get(f.cls, 0.0) + ((done - saved) + (restart_at - f.time)) * gpu_h
        start = restart_at
        if memory and source == "peer":
            # until the first memory snapshot after the restart, the failed node's shards live only on
            # its partner, and the shards it held for its neighbour only on that neighbour
            exposed = {partner(p, f.node), (f.node - (1 if p.placement == "adjacent" else p.domain_nodes)) % p.nodes}
            exposed_until = start + cycle
            rollback = saved - durable
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
    fallbacks_mean: float = 0.0
    interval: str = ""


def interval_text(p: Params, strategy: str) -> str:
    if strategy in MEMORY_STRATEGIES:
        return f"K={p.memory_interval_steps} steps"
    return f"{p.interval_hours * 60:.1f} min"


def summarise(p: Params, strategy: str, draws: list[list[Failure]]) -> Summary:
    outs = [simulate(p, strategy, d) for d in draws]
    runs = len(outs)
    ettrs = sorted(o.ettr for o in outs)
    lost: dict[str, float] = {}
    for o in outs:
        for k, v in o.lost_gpu_hours.items():
            lost[k] = lost.get(k, 0.0) + v / runs
    return Summary(strategy, statistics.fmean(ettrs), ettrs[int(0.05 * len(ettrs))], lost,
                   sum(o.waited_for_spare for o in outs) / runs, statistics.fmean(o.failures for o in outs),
                   statistics.fmean(o.migrations for o in outs), statistics.fmean(o.fallbacks for o in outs),
                   interval_text(p, strategy))


def run(p: Params, runs: int = 200, seed: int = 0, strategies: tuple[str, ...] = STRATEGIES,
        optimise: bool = False, optimise_runs: int = 20) -> dict[str, Summary]:
    """Every strategy over the same ``runs`` failure draws; with ``optimise``, each at its best interval."""
    rng = random.Random(seed)
    draws = [draw_failures(p, rng) for _ in range(runs)]
    out = {}
    for s in strategies:
        q = optimise_interval(p, s, draws[:optimise_runs]) if optimise else p
        out[s] = summarise(q, s, draws)
    return out


def _golden(f, lo: float, hi: float, iters: int) -> float:
    """Maximise a unimodal f on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def optimise_interval(p: Params, strategy: str, draws: list[list[Failure]], iters: int = 14) -> Params:
    """The interval that maximises mean ETTR over ``draws`` (common random numbers), by a golden-
    section search in log(interval), started around Young/Daly: the disk interval for the disk
    strategies, K (whole steps) for the memory tier."""
    if not draws:
        raise ValueError("optimise_interval needs at least one failure draw")

    def mean_ettr(q: Params) -> float:
        return statistics.fmean(simulate(q, strategy, d).ettr for d in draws)

    if strategy in MEMORY_STRATEGIES:
        cache: dict[int, float] = {}

        def at_k(log_k: float) -> float:
            k = max(1, round(math.exp(log_k)))
            if k not in cache:
                cache[k] = mean_ettr(replace(p, memory_interval_steps=k))
            return cache[k]

        step_h = p.step_seconds / H
        yd = young_daly_for(p.memory_block_h(), p.failures_per_hour) / step_h
        hi = max(2.0, min(1e6, 20 * yd))
        _golden(at_k, 0.0, math.log(hi), iters)
        best = max(cache, key=lambda k: (cache[k], -k))
        return replace(p, memory_interval_steps=best)
    block = p.write_h() if strategy == "periodic" else min(p.write_h(), p.stage_h())
    lo = max(1 / 60, p.write_h() if strategy != "periodic" else 0.0, p.step_seconds / H)  # async: one write at a time
    yd = young_daly_for(block, p.failures_per_hour)
    hi = max(lo * 4, min(24 * p.days, 10 * yd, 48.0))
    seen: dict[float, float] = {}

    def at(log_dt: float) -> float:
        dt = math.exp(log_dt)
        seen[dt] = mean_ettr(replace(p, interval_hours=dt))
        return seen[dt]

    _golden(at, math.log(lo), math.log(hi), iters)
    return replace(p, interval_hours=max(seen, key=seen.__getitem__))


def young_daly_for(cost_hours: float, failures_per_hour: float) -> float:
    return math.sqrt(2 * cost_hours / failures_per_hour) if failures_per_hour > 0 else math.inf


def closed_form_ettr(p: Params) -> float:
    """Meta's expected ETTR for periodic checkpointing (Kokolis et al. 2024)."""
    lam = p.failures_per_hour
    return (1 - lam * (p.restart_h("disk") + p.interval_hours / 2)) / (1 + p.write_h() / p.interval_hours)


def young_daly(p: Params) -> float:
    return young_daly_for(p.write_h(), p.failures_per_hour)


def double_failure_probability(p: Params) -> float:
    """Per sudden node loss, the chance both holders of some shard are gone (the memory tier falls
    back to disk): a domain-wide failure whose domain holds the partner, plus an independent
    failure of one of the two exposed neighbours before the replicas are re-made (restart + one
    memory interval)."""
    weights = {c[0]: c[1] * (1 - c[2]) for c in p.classes}  # sudden (unpredicted) share per class
    sudden_loss = sum(w for c, w in weights.items() if c not in PROCESS_CLASSES)
    if sudden_loss == 0:
        return 0.0
    same_domain = 0.0
    if p.placement == "adjacent" and p.domain_nodes > 1:
        same_domain = (p.domain_nodes - 1) / p.domain_nodes
    domain = sum(w for c, w in weights.items() if c in DOMAIN_CLASSES) / sudden_loss * same_domain
    window = p.restart_h("peer") + p.memory_interval_steps * (p.step_seconds / H + p.memory_block_h())
    node_loss_rate = p.rate_per_node_day / 24.0 * sum(c[1] for c in p.classes if c[0] not in PROCESS_CLASSES) / sum(
        c[1] for c in p.classes)
    return domain + (1 - domain) * (1 - math.exp(-2 * node_loss_rate * window))


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
             f"write {p.write_h() * H:.1f} s, stage {p.stage_h() * H:.2f} s, restart from disk {p.restart_h('disk') * 60:.2f} min, "
             f"migrate {p.migrate_h() * H:.1f} s, spares {'unlimited' if p.spares is None else p.spares}",
             f"{'strategy':<44} {'interval':>12} {'ETTR':>7} {'p5 ETTR':>8} {'lost GPU-h':>11} {'failures':>9} "
             f"{'migrations':>11} {'fallbacks':>10} {'P(spares dry)':>14}"]
    for s in results.values():
        lines.append(f"{LABELS[s.strategy]:<44} {s.interval:>12} {s.ettr_mean:>7.4f} {s.ettr_p5:>8.4f} "
                     f"{sum(s.lost_gpu_hours.values()):>11,.0f} {s.failures_mean:>9.1f} {s.migrations_mean:>11.1f} "
                     f"{s.fallbacks_mean:>10.2f} {s.spare_exhaustion:>14.3f}")
    first = next(iter(results.values()))
    top = sorted(first.lost_gpu_hours.items(), key=lambda kv: -kv[1])[:5]
    lines.append(f"largest causes of lost GPU-hours ({first.strategy}): " + ", ".join(f"{k} {v:,.0f}" for k, v in top))
    return "\n".join(lines)


PLOT_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000)


def plot(path: str, base: Params, runs: int, seed: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install 'sentinel-gpu[plot]'") from None
    curves: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    for n in PLOT_SIZES:
        res = run(replace(base, gpus=n), runs=runs, seed=seed, optimise=True, optimise_runs=min(runs, 10))
        for s in STRATEGIES:
            curves[s].append(res[s].ettr_mean)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for s, ys in curves.items():
        ax.plot(PLOT_SIZES, ys, marker="o", label=LABELS[s])
    ax.axhline(0.97, color="grey", ls=":", lw=1)
    ax.axhline(0.95, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (productive / wall time)")
    ax.set_title(f"ETTR vs scale, each strategy at its best interval\n({base.days:g} days, "
                 f"{base.rate_per_node_day * 1000:.2f} failures/1k node-days, inputs: docs/measured.json)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- sensitivity: what must hold for a target ETTR ---------------------------------------------------
def _threshold(ok, lo: float, hi: float, increasing: bool, iters: int = 12) -> float | None:
    """The boundary of {x in [lo, hi]: ok(x)} for a monotone ok: the smallest passing x when
    passing needs x large (``increasing``), else the largest. None when nothing in range passes."""
    if increasing:
        if not ok(hi):
            return None
        if ok(lo):
            return lo
        for _ in range(iters):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi
    if not ok(lo):
        return None
    if ok(hi):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _scaled_classes(p: Params, factor: float) -> tuple[tuple[str, int, float], ...]:
    return tuple((c, n, min(1.0, f * factor)) for c, n, f in p.classes)


def predictable_share(classes: tuple[tuple[str, int, float], ...]) -> float:
    return sum(n * f for _, n, f in classes) / sum(n for _, n, _ in classes)


@dataclass
class Requirement:
    parameter: str
    base: str
    needed: str


def sensitivity(base: Params, target: float, strategy: str = "sentinel_memory_spare", runs: int = 20,
                seed: int = 0) -> tuple[float, list[Requirement]]:
    """One parameter at a time, the others at ``base``: the value each must reach for mean ETTR
    >= target with ``strategy`` at its best interval. Returns (ETTR at base, requirements)."""
    rng = random.Random(seed)
    draws = [draw_failures(base, rng) for _ in range(runs)]
    best = optimise_interval(base, strategy, draws)

    def ettr(q: Params, redraw: bool = False) -> float:
        ds = draws
        if redraw:  # predictable fractions change the draws themselves (same seed: common numbers)
            r = random.Random(seed)
            ds = [draw_failures(q, r) for _ in range(runs)]
        return statistics.fmean(simulate(q, strategy, d).ettr for d in ds)

    at_base = ettr(best)
    reqs: list[Requirement] = []
    share0 = predictable_share(base.classes)
    top = 1 / max(1e-9, max(f for _, _, f in base.classes))
    x = _threshold(lambda m: ettr(replace(best, classes=_scaled_classes(best, m)), redraw=True) >= target,
                   0.0, top * 1.0, increasing=True, iters=8)
    reqs.append(Requirement("predictable share of failures (lead >= 2 min)", f"{share0:.1%}",
                            "not reachable" if x is None else f">= {predictable_share(_scaled_classes(best, x)):.1%}"))
    r0 = best.restart_h("peer") * H
    # the whole restart from disk, whatever its parts; memory and peer restarts follow from it
    x = _threshold(lambda r: ettr(replace(best, restart_hours=r)) >= target, best.restore_disk_h(), 2.0, increasing=False)
    need = None if x is None else replace(best, restart_hours=x).restart_h("peer") * H
    reqs.append(Requirement("restart after a node loss (from the peer replica)", f"{r0:.0f} s",
                            "not reachable" if need is None else f"<= {need:,.0f} s"))
    k0 = best.memory_interval_steps
    x = _threshold(lambda k: ettr(replace(best, memory_interval_steps=max(1, round(k)))) >= target, k0, 20000.0,
                   increasing=False)
    reqs.append(Requirement("memory-tier interval K (steps)", f"{k0} ({k0 * best.step_seconds:.0f} s)",
                            "not reachable" if x is None else f"<= {round(x)} ({round(x) * best.step_seconds:,.0f} s)"))
    f0 = best.memory_block_h() * H / best.step_seconds
    x = _threshold(lambda f: ettr(optimise_interval(replace(best, memory_overhead_fraction=f), strategy, draws[:5])) >= target,
                   0.0, 1.0, increasing=False, iters=8)
    reqs.append(Requirement("memory snapshot stall (fraction of a step)", f"{f0:.3f}",
                            "not reachable" if x is None else f"<= {x:.3f}"))
    s0 = "unlimited" if best.spares is None else str(best.spares)
    x = _threshold(lambda s: ettr(replace(best, spares=round(s))) >= target, 0, 4 * max(8, best.nodes // 50), increasing=True,
                   iters=10)
    reqs.append(Requirement(f"spare nodes ({best.repair_hours:g} h repairs)", s0,
                            "not reachable" if x is None else f">= {round(x)}"))
    return at_base, reqs


def sensitivity_table(rows: list[tuple[str, float, float, list[Requirement]]]) -> str:
    """Markdown: one column per (scale, target)."""
    head = "| parameter | measured / assumed | " + " | ".join(f"needed for ETTR >= {t:.2f} at {g:,} GPUs (now {e:.3f})"
                                                             for g, t, e, _ in rows) + " |"
    lines = [head, "|---|---|" + "---|" * len(rows)]
    for i, req in enumerate(rows[0][3]):
        lines.append(f"| {req.parameter} | {req.base} | " + " | ".join(r[3][i].needed for r in rows) + " |")
    return "\n".join(lines)


# -- Llama 3 -------------------------------------------------------------------------------------------
def llama3_params(restart_minutes: float, **over) -> Params:
    """Llama 3 405B as published (Dubey et al. 2024, section 3.3.4): 466 interruptions (419
    unexpected + 47 planned) in 54 days on 16,384 H100s; checkpoints of up to 4 GB per GPU to
    Tectonic at 2 TB/s sustained. The paper gives no restart time: it is the free parameter."""
    kw = dict(gpus=16384, days=54.0, rate_per_node_day=LLAMA3_ALL_INTERRUPTIONS / 2048 / 54, state_gb_per_gpu=4.0,
              node_write_gbps=1e9, fs_ceiling_gbps=2000.0, restart_hours=restart_minutes / 60, prediction=False)
    kw.update(over)
    return Params(**kw)


def llama3_restart_budget(strategy: str = "periodic", runs: int = 20, seed: int = 0) -> float:
    """The longest mean restart (minutes) for which ``strategy`` at its best interval keeps
    Llama 3's published > 90 % effective training time."""
    def ettr(minutes: float) -> float:
        p = llama3_params(minutes)
        rng = random.Random(seed)
        draws = [draw_failures(p, rng) for _ in range(runs)]
        return statistics.fmean(simulate(optimise_interval(p, strategy, draws[:5]), strategy, d).ettr for d in draws)

    return _threshold(lambda m: ettr(m) > 0.90, 0.0, 60.0, increasing=False, iters=10) or 0.0


# -- the command ---------------------------------------------------------------------------------------
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--measured", nargs="+", metavar="FILE", default=[],
                    help="bench --json reports or docs/measured.json: measured inputs (typed flags still override)")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3", help="failure rate preset")
    ap.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    g = ap.add_argument_group("intervals (default: each strategy's best, searched)")
    g.add_argument("--interval-minutes", type=float, help="fix the disk checkpoint interval")
    g.add_argument("--memory-interval-steps", type=int, help="fix the memory-tier interval K")
    g.add_argument("--step-seconds", type=float, default=6.0, help="training step time (Llama 3 405B: ~6 s)")
    g = ap.add_argument_group("inputs (default: measured with --measured, else the assumption docs/goodput.md names)")
    g.add_argument("--state-gb-per-gpu", type=float, default=0.4, help="checkpoint state per GPU (405B x 16 B / 16,384)")
    g.add_argument("--node-write-gbps", type=float, help="per-node write/read bandwidth to the shared filesystem")
    g.add_argument("--fs-ceiling-gbps", type=float, default=2000.0, help="shared filesystem ceiling (Llama 3: 2 TB/s)")
    g.add_argument("--stall-seconds-per-gb", type=float, help="async snapshot stall per GB of state per rank")
    g.add_argument("--write-minutes", type=float, help="fix the checkpoint write time (overrides the bandwidth model)")
    g.add_argument("--detect-seconds", type=float)
    g.add_argument("--restart-extra-seconds", type=float, default=120.0,
                   help="typed, GPU-only and cluster terms one machine cannot measure: scheduler, NCCL communicator "
                        "set-up at scale, data loader and compile warm-up (docs/goodput.md)")
    g.add_argument("--restart-minutes", type=float, help="fix the whole restart from disk (overrides the parts)")
    g.add_argument("--restore-memory-seconds", type=float)
    g.add_argument("--restore-peer-seconds", type=float)
    g.add_argument("--restore-disk-seconds", type=float)
    g.add_argument("--migrate-minutes", type=float, help="predicted failure: snapshot + spare, cold spare")
    g.add_argument("--migrate-warm-seconds", type=float, help="the same with a warm spare")
    g.add_argument("--memory-overhead-fraction", type=float,
                   help="a memory snapshot's whole cost as a fraction of a step (overrides the per-GB terms)")
    g.add_argument("--memory-stall-seconds-per-gb", type=float, help="memory snapshot stall per GB of state per rank")
    g.add_argument("--memory-cpu-seconds-per-gb", type=float, help="memory snapshot background CPU per GB per rank")
    g.add_argument("--async-cpu-seconds-per-gb", type=float, help="async disk snapshot background CPU per GB per rank")
    g.add_argument("--background-contention", type=float, default=0.0,
                   help="wall-clock seconds one CPU-second of a snapshot's background work costs the step on the GPU "
                        "node's host (default 0: tens of idle cores, docs/goodput.md); this machine's is measured "
                        "(memory_tier: reference_contention_ratio) and shown beside it")
    g.add_argument("--placement", choices=PLACEMENTS, default="cross_domain",
                   help="where a node's memory replica lives: another failure domain, or the next node")
    g.add_argument("--domain-nodes", type=int, default=2, help="nodes per failure domain (rack switch / power)")
    g.add_argument("--lead-mean-minutes", type=float, default=30.0)
    ap.add_argument("--spares", type=int, default=None, help="spare nodes (default: unlimited)")
    ap.add_argument("--repair-hours", type=float, default=72.0)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prediction", action="store_true")
    ap.add_argument("--size-spares", action="store_true", help="find the pool size keeping P(dry) < 1 %%")
    ap.add_argument("--sensitivity", action="store_true",
                    help="what must hold for ETTR >= 0.97 at 16,384 GPUs and >= 0.95 at 100,000")
    ap.add_argument("--plot", metavar="PNG", help="also plot ETTR vs N (1k..100k GPUs); needs matplotlib")
    g = ap.add_argument_group("fault trace (docs/goodput.md, 'Replaying a fault trace')")
    g.add_argument("--trace", metavar="FILE", help="replay this node fault trace (JSON or CSV) instead of drawing "
                   "Poisson failures; --spares then adds spare nodes outside the trace that never fail")
    g.add_argument("--trace-format", choices=("auto", "events", "fault-records"), default="auto",
                   help="events: Sentinel's JSON/CSV; fault-records: a JSON list of {node_id, event_time, event_type, "
                   "fault_type: {Level, Class, Desc}} as public traces are published; auto (default): told apart by "
                   "the first record")
    g.add_argument("--trace-time-unit", choices=("seconds", "hours", "days"), default=None,
                   help="unit of a fault-records trace's event_time (default: days, the published traces' unit)")
    g.add_argument("--trace-nodes", type=int, default=None, metavar="N",
                   help="the traced cluster's node count when the trace does not say (nodes that never failed "
                   "appear in no record)")
    g.add_argument("--trace-classes", metavar="TOML", help="fault class table entries that replace or extend the "
                   "shipped one (sentinel_tools/sim/trace_classes.toml)")
    g.add_argument("--breaker-max-fraction", type=float, default=0.5,
                   help="circuit breaker: most of the partition Sentinel may drain in the window (actions.breaker_max_fraction)")
    g.add_argument("--breaker-window-seconds", type=float, default=300.0, help="circuit breaker window")


def params_from(args: argparse.Namespace) -> tuple[Params, dict[str, str], bool]:
    """Params, where each input came from, and whether intervals are to be searched.
    Raises measured.MeasuredError (a file it cannot use) or ValueError (a bad value)."""
    from sentinel_tools.sim import measured

    base = Params()
    typed = {"stall_seconds_per_gb": args.stall_seconds_per_gb, "node_write_gbps": args.node_write_gbps,
             "memory_overhead_fraction": args.memory_overhead_fraction,
             "memory_stall_seconds_per_gb": args.memory_stall_seconds_per_gb,
             "memory_cpu_seconds_per_gb": args.memory_cpu_seconds_per_gb,
             "async_cpu_seconds_per_gb": args.async_cpu_seconds_per_gb,
             "migrate_seconds": None if args.migrate_minutes is None else args.migrate_minutes * 60,
             "migrate_warm_seconds": args.migrate_warm_seconds, "restore_memory_seconds": args.restore_memory_seconds,
             "restore_peer_seconds": args.restore_peer_seconds, "restore_disk_seconds": args.restore_disk_seconds,
             "detect_seconds": args.detect_seconds, "restart_curve": None}
    defaults = {f.name: getattr(base, f.name) for f in fields(Params)}
    gpus_per_node = base.gpus_per_node
    reports = measured.load_all(args.measured)
    values, where = measured.resolve(reports, typed, defaults, max(1, args.gpus // gpus_per_node))
    p = Params(gpus=args.gpus, days=args.days, rate_per_node_day=PRESETS[args.preset],
               interval_hours=(args.interval_minutes or 30.0) / 60,
               memory_interval_steps=args.memory_interval_steps or 1, step_seconds=args.step_seconds,
               state_gb_per_gpu=args.state_gb_per_gpu, fs_ceiling_gbps=args.fs_ceiling_gbps,
               write_hours=None if args.write_minutes is None else args.write_minutes / 60,
               restart_extra_seconds=args.restart_extra_seconds,
               restart_hours=None if args.restart_minutes is None else args.restart_minutes / 60,
               placement=args.placement, domain_nodes=args.domain_nodes, lead_mean_hours=args.lead_mean_minutes / 60,
               spares=None if getattr(args, "trace", None) else args.spares, repair_hours=args.repair_hours,
               prediction=not args.no_prediction, breaker_max_fraction=args.breaker_max_fraction,
               breaker_window_seconds=args.breaker_window_seconds,
               background_contention=args.background_contention, **values)
    for name, flag in (("write_hours", "--write-minutes"), ("restart_hours", "--restart-minutes")):
        if getattr(p, name) is not None:
            where[name] = f"typed ({flag})"
    here = [r.figures["reference_contention_ratio"] for r in reports if "reference_contention_ratio" in r.figures]
    where["background_contention"] = ("typed (--background-contention)" if args.background_contention else
                                      "default: a GPU node's host, tens of idle cores (docs/goodput.md)") + (
        f"; this machine measured {here[-1]:.2f} (memory_tier: reference_contention_ratio, 2 cores, 4 ranks), "
        "not applied" if here else "")
    search = args.interval_minutes is None and args.memory_interval_steps is None
    return p, where, search


def provenance(p: Params, where: dict[str, str]) -> str:
    shown = {
        "stall_seconds_per_gb": f"{p.stall_seconds_per_gb:.3f} s/GB -> async stall {p.stage_h() * H:.2f} s",
        "node_write_gbps": f"{p.node_write_gbps:.2f} GB/s per node -> write {p.write_h() * H:.1f} s at {p.nodes:,} nodes "
                           f"(ceiling {p.fs_ceiling_gbps:,.0f} GB/s)",
        "memory_stall_seconds_per_gb": f"{p.memory_stall_seconds_per_gb:.3f} s/GB",
        "memory_cpu_seconds_per_gb": f"{p.memory_cpu_seconds_per_gb:.3f} CPU-s/GB",
        "async_cpu_seconds_per_gb": f"{p.async_cpu_seconds_per_gb:.3f} CPU-s/GB",
        "background_contention": f"{p.background_contention:.2f} s per CPU-s",
        "memory_overhead_fraction": (f"memory snapshot {p.memory_block_h() * H:.3f} s (async {p.stage_h() * H:.3f} s)"
                                     f" = {p.memory_block_h() * H / p.step_seconds:.4f} of a {p.step_seconds:g} s step"),
        "migrate_seconds": f"{p.migrate_seconds:.1f} s -> {p.migrate_h() * H:.1f} s at {p.nodes:,} nodes",
        "migrate_warm_seconds": f"{p.migrate_warm_seconds:.1f} s -> {p.migrate_h(warm=True) * H:.1f} s at {p.nodes:,} nodes",
        "restore_memory_seconds": f"{p.restore_memory_seconds:.2f} s",
        "restore_peer_seconds": f"{p.restore_peer_seconds:.2f} s",
        "restore_disk_seconds": f"{p.restore_disk_seconds:.2f} s -> {p.restore_disk_h() * H:.1f} s at {p.nodes:,} nodes",
        "detect_seconds": f"{p.detect_seconds:.3f} s",
        "restart_curve": f"rendezvous protocol {p.curve_seconds(p.nodes):.3f} s at {p.nodes:,} nodes",
    }
    lines = ["inputs:"]
    for name, text in shown.items():
        lines.append(f"  {name:<25} {text:<62} <- {where.get(name, 'default')}")
    lines.append(f"  {'restart, term by term':<25} detect {p.detect_seconds:.2f} s + protocol {p.curve_seconds(p.nodes):.3f} s "
                 f"(measured curve) + extra {p.restart_extra_seconds:g} s (typed: scheduler, NCCL set-up, warm-up) + restore "
                 f"(disk {p.restore_disk_h() * H:.1f} / peer {p.restore_peer_seconds:.1f} / memory {p.restore_memory_seconds:.1f} s)"
                 f" = disk {p.restart_h('disk') * H:.0f} s, peer {p.restart_h('peer') * H:.0f} s, memory {p.restart_h('memory') * H:.0f} s")
    for name in ("write_hours", "restart_hours"):
        if name in where:
            lines.append(f"  {name:<25} {getattr(p, name) * 60:.2f} min  <- {where[name]}")
    return "\n".join(lines)


def main_args(args: argparse.Namespace) -> int:
    from sentinel_tools.sim.measured import MeasuredError

    try:
        p, where, search = params_from(args)
    except (MeasuredError, ValueError) as exc:
        print(f"sentinel simulate goodput: {exc}", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("sentinel simulate goodput: --runs must be >= 1", file=sys.stderr)
        return 2
    print(provenance(p, where))
    if args.trace:
        from sentinel_tools.sim import trace

        return trace.main(args, p, search)
    strategies = tuple(args.strategies)
    print(table(run(p, runs=args.runs, seed=args.seed, strategies=strategies, optimise=search,
                    optimise_runs=min(args.runs, 20)), p))
    print(f"closed-form periodic ETTR: {closed_form_ettr(p):.4f} (at {p.interval_hours * 60:.0f} min); "
          f"Young/Daly interval: {young_daly(p) * 60:.1f} min; P(both replica holders lost | sudden node loss, "
          f"{p.placement}): {double_failure_probability(p):.2e}")
    from sentinel_tools.sim import placement  # what a far spare and a same-rack replica cost (docs/topology.md)

    print("\n".join(placement.summary_lines(p, runs=min(args.runs, 5), seed=args.seed)))
    if args.size_spares:
        for s in strategies:
            print(f"spares for P(pool dry) < 1 % ({s}): {min_spares(p, runs=args.runs, seed=args.seed, strategy=s)}")
    if args.sensitivity:
        rows = []
        for gpus, target in ((16384, 0.97), (100_000, 0.95)):
            e, reqs = sensitivity(replace(p, gpus=gpus), target, runs=min(args.runs, 20), seed=args.seed)
            rows.append((gpus, target, e, reqs))
        print(sensitivity_table(rows))
    if args.plot:
        plot(args.plot, p, runs=max(10, args.runs // 10), seed=args.seed)
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sentinel simulate goodput")
    add_arguments(ap)
    return main_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
