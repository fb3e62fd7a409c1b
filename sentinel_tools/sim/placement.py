"""What placement costs at scale: the spare Sentinel admits and where the memory tier keeps its
replica (``sentinel simulate placement``; a summary also closes ``sentinel simulate goodput``).

The cluster: ``gpus`` GPUs, ``gpus_per_node`` per node, ``domain_nodes`` nodes per NVLink domain
(one rack and power feed, as a GB200 NVL72), of which ``spares_per_domain`` wait as spares;
``domains_per_leaf`` domains per leaf switch, ``leaves_per_spine`` leaves per spine, spines under
one core. Training is FSDP (HSDP): each shard group is the job's GPUs of one NVLink domain; per
step it all-gathers the parameters (forward and backward) and reduce-scatters the gradients as a
ring over its members. A ring runs at its slowest edge: a member outside the domain puts two
edges of the ring on the scale-out network.

* **Bytes crossing each tier per step** — per ring edge, ``(g - 1) / g`` of the group's bytes
  per collective; each edge is counted at the tier where its two nodes meet (NVLink, leaf, spine,
  core).
* **Step time** — compute plus the communication that compute does not hide
  (``max(0, comm - overlap x compute)``), the communication time being the bytes per GPU over
  the slowest edge's per-GPU bandwidth.
* **Far spare** — Monte Carlo over the same failure draws as the goodput simulator: every node
  loss takes a spare, either the nearest free one (Sentinel: same NVLink domain, else same leaf,
  else same spine, else any) or a random free one (the first waiting); a spare outside the
  departed node's domain slows its group, and the job waits for its slowest group, until the
  repaired node returns (``far_hold_hours``). The ETTR factor is the time-average of
  ``compute step / actual step``.
* **Replica placement** — the probability that a sudden node loss loses both copies of a shard,
  for the memory tier's replica in the same rack (``(n + 1) mod N`` on consecutive nodes) and in
  another rack (:func:`sentinel.topology.replica_plan`), with the goodput simulator's ETTR for each.

Every input is typed with its source (:data:`SOURCES`) and printed with the result.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
from dataclasses import dataclass, fields, replace

from sentinel_tools.sim import goodput

TIERS = ("nvlink", "leaf", "spine", "core")

#: where each default comes from
SOURCES = {
    "gpus_per_node": "GB200 NVL72: 4 GPUs per compute tray (NVIDIA GB200 NVL72 datasheet)",
    "domain_nodes": "GB200 NVL72: 18 compute trays per NVLink domain (NVIDIA datasheet)",
    "spares_per_domain": "2 of 18 trays held as in-rack spares (a common NVL72 operating practice; assumption)",
    "domains_per_leaf": "assumption: 2 racks per scale-out leaf switch",
    "leaves_per_spine": "assumption: 16 leaves per spine group",
    "nvlink_gbps": "NVLink 5: 1.8 TB/s bidirectional per GPU = 900 GB/s each way (NVIDIA)",
    "leaf_gbps": "one 400 Gb/s NIC per GPU (ConnectX-7) = 50 GB/s",
    "spine_gbps": "non-blocking leaf-spine: 50 GB/s per GPU (assumption)",
    "core_gbps": "2:1 oversubscribed above the spine: 25 GB/s per GPU (assumption)",
    "params_per_group": "Llama 3 405B over TP 8 x PP 16 = 128 model-parallel slices: 405e9 / 128 parameters "
                        "(Dubey et al. 2024); the shard group all-gathers one slice",
    "bytes_per_param": "bf16 parameters and gradients",
    "compute_seconds": "Llama 3 405B step ~6 s at 16,384 GPUs (as the goodput simulator)",
    "overlap": "share of the compute time that hides communication: 0 = none hidden (upper bound; set the job's own)",
    "far_hold_hours": "a far spare stays until the repaired node returns (the goodput simulator's repair time, 72 h)",
}


@dataclass(frozen=True)
class Cluster:
    gpus: int = 16384
    gpus_per_node: int = 4
    domain_nodes: int = 18
    spares_per_domain: int = 2
    domains_per_leaf: int = 2
    leaves_per_spine: int = 16
    nvlink_gbps: float = 900.0
    leaf_gbps: float = 50.0
    spine_gbps: float = 50.0
    core_gbps: float = 25.0
    params_per_group: float = 405e9 / 128
    bytes_per_param: float = 2.0
    compute_seconds: float = 6.0
    overlap: float = 0.0
    far_hold_hours: float = 72.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, not {v!r}")
        if self.gpus_per_node < 1 or self.domain_nodes < 1 or self.domains_per_leaf < 1 or self.leaves_per_spine < 1:
            raise ValueError("gpus_per_node, domain_nodes, domains_per_leaf and leaves_per_spine must be >= 1")
        if self.spares_per_domain >= self.domain_nodes:
            raise ValueError("spares_per_domain must be < domain_nodes")
        if self.overlap > 1:
            raise ValueError("overlap must be within 0..1")

    @property
    def active_per_domain(self) -> int:
        return self.domain_nodes - self.spares_per_domain

    @property
    def domains(self) -> int:
        return max(1, math.ceil(self.gpus / (self.gpus_per_node * self.active_per_domain)))

    @property
    def group_gpus(self) -> int:
        return self.active_per_domain * self.gpus_per_node

    def bandwidth(self, tier: str) -> float:
        return {"nvlink": self.nvlink_gbps, "leaf": self.leaf_gbps, "spine": self.spine_gbps, "core": self.core_gbps}[tier]

    def tier_between(self, domain_a: int, domain_b: int) -> str:
        """Where two nodes' traffic meets, from their NVLink domains' indices."""
        if domain_a == domain_b:
            return "nvlink"
        if domain_a // self.domains_per_leaf == domain_b // self.domains_per_leaf:
            return "leaf"
        per_spine = self.domains_per_leaf * self.leaves_per_spine
        return "spine" if domain_a // per_spine == domain_b // per_spine else "core"


@dataclass(frozen=True)
class GroupTraffic:
    bytes_per_tier: dict[str, float]  # bytes crossing each tier per step, the whole group
    comm_seconds: float
    step_seconds: float


def group_traffic(c: Cluster, member_domains: list[int], home: int) -> GroupTraffic:
    """One shard group's ring, members in ring order by node (each node's GPUs consecutive, so
    intra-node edges are NVLink), members in ``home`` or elsewhere (a spare from another domain)."""
    g = len(member_domains) * c.gpus_per_node
    per_collective = c.params_per_group * c.bytes_per_param
    edge_bytes = per_collective * (g - 1) / g if g > 1 else 0.0
    collectives = 3  # all-gather forward, all-gather backward, reduce-scatter of the gradients
    out = {t: 0.0 for t in TIERS}
    slowest = math.inf
    nodes = len(member_domains)
    for i in range(nodes):
        a, b = member_domains[i], member_domains[(i + 1) % nodes]
        tier = c.tier_between(a, b)
        out[tier] += edge_bytes * collectives
        out["nvlink"] += edge_bytes * collectives * (c.gpus_per_node - 1)  # the node's own GPUs
        slowest = min(slowest, c.bandwidth(tier))
    if nodes == 1:
        slowest = c.nvlink_gbps
    comm = collectives * edge_bytes / (slowest * 1e9) if slowest > 0 else math.inf
    step = c.compute_seconds + max(0.0, comm - c.overlap * c.compute_seconds)
    return GroupTraffic(out, comm, step)


def step_for_tier(c: Cluster, tier: str) -> GroupTraffic:
    """A group with one member from the nearest domain that meets ``tier`` (nvlink: none)."""
    members = [0] * c.active_per_domain
    if tier != "nvlink":
        other = {"leaf": 1, "spine": c.domains_per_leaf, "core": c.domains_per_leaf * c.leaves_per_spine}[tier]
        members[len(members) // 2] = other
    return group_traffic(c, members, 0)


# -- the far-spare Monte Carlo ------------------------------------------------------------------------
@dataclass(frozen=True)
class SpareOutcome:
    policy: str
    ettr_factor: float  # time-average of compute step / actual step
    share_by_tier: dict[str, float]  # of replacements, where the spare came from
    slow_hours: float  # hours with at least one group slowed


def spare_monte_carlo(c: Cluster, p: goodput.Params, policy: str, runs: int, seed: int) -> SpareOutcome:
    """``policy``: "nearest" (Sentinel) or "random" (the first waiting spare anywhere)."""
    if policy not in ("nearest", "random"):
        raise ValueError(f"unknown spare policy {policy!r}")
    rng = random.Random(seed)
    p = replace(p, gpus=c.domains * c.active_per_domain * c.gpus_per_node, gpus_per_node=c.gpus_per_node)
    horizon = p.days * 24.0
    slow_step = {t: step_for_tier(c, t).step_seconds for t in TIERS}
    counts = {t: 0 for t in TIERS}
    total_lost = 0.0
    slow_hours = 0.0
    for _ in range(runs):
        failures = goodput.draw_failures(p, rng)
        pick = random.Random(rng.random())
        free = [c.spares_per_domain] * c.domains
        returns: list[tuple[float, int]] = []  # (time, domain) repaired nodes returning as spares
        windows: list[tuple[float, float, float]] = []  # (start, end, step seconds) of slowed periods
        for f in failures:
            if f.cls in goodput.PROCESS_CLASSES:
                continue
            while returns and returns[0][0] <= f.time:
                _, d = returns.pop(0)
                free[d] += 1
            home = (f.node // c.active_per_domain) % c.domains
            total = sum(free)
            if total == 0:
                continue  # the job waits for a repaired node: the goodput simulator counts that
            if policy == "nearest":
                spare = min((d for d in range(c.domains) if free[d]), key=lambda d: (TIERS.index(c.tier_between(home, d)), d))
            else:
                k = pick.randrange(total)
                spare = 0
                while k >= free[spare]:
                    k -= free[spare]
                    spare += 1
            free[spare] -= 1
            bisect.insort(returns, (f.time + p.repair_hours, home))
            tier = c.tier_between(home, spare)
            counts[tier] += 1
            if tier != "nvlink":
                windows.append((f.time, min(horizon, f.time + c.far_hold_hours), slow_step[tier]))
        # the job runs at its slowest group's pace: sweep the windows
        events = sorted([(s, 1, st) for s, e, st in windows] + [(e, -1, st) for s, e, st in windows])
        active: dict[float, int] = {}
        last = 0.0
        for t, kind, st in events:
            if active:
                worst = max(active)
                total_lost += (t - last) * (1 - c.compute_seconds / worst)
                slow_hours += t - last
            last = t
            active[st] = active.get(st, 0) + kind
            if active[st] == 0:
                del active[st]
    n = sum(counts.values()) or 1
    return SpareOutcome(policy, 1 - total_lost / (runs * horizon), {t: v / n for t, v in counts.items()},
                        slow_hours / runs)


# -- replicas -----------------------------------------------------------------------------------------
def same_rack_share_of_plans(c: Cluster) -> tuple[float, float]:
    """Share of nodes whose replica shares their rack: the old ring over consecutive nodes, and
    :func:`sentinel.topology.replica_plan` on the same cluster (checked, not assumed)."""
    from sentinel import topology

    readings, nodes = [], []
    for d in range(c.domains):
        for k in range(c.active_per_domain):
            name = f"d{d}n{k}"
            nodes.append(name)
            leaf = d // c.domains_per_leaf
            readings.append(topology.Reading(name, "sim", topology.Place(
                nvlink=f"nvl{d}", switches=(f"leaf{leaf}", f"spine{leaf // c.leaves_per_spine}"), rack=f"rack{d}")))
    topo = topology.merge(readings)
    ring = sum(topo.place(nodes[i]).rack == topo.place(nodes[(i + 1) % len(nodes)]).rack for i in range(len(nodes)))
    plan = topology.replica_plan(topo, nodes)
    planned = sum(topo.place(nodes[i]).rack == topo.place(nodes[h]).rack for i, h in enumerate(plan.holder))
    return ring / len(nodes), planned / len(nodes)


def report(c: Cluster, p: goodput.Params, runs: int, seed: int, ettr_runs: int) -> str:
    p = replace(p, gpus=c.domains * c.active_per_domain * c.gpus_per_node, gpus_per_node=c.gpus_per_node,
                domain_nodes=c.active_per_domain)
    lines = [f"placement at {p.gpus:,} GPUs: {c.domains} NVLink domains of {c.domain_nodes} nodes x {c.gpus_per_node} GPUs "
             f"({c.spares_per_domain} spares each), {c.domains_per_leaf} domains per leaf, {c.leaves_per_spine} leaves per spine; "
             f"FSDP shard group = one domain's {c.group_gpus} GPUs"]
    lines.append("inputs:")
    for f in fields(c):
        if f.name in SOURCES:
            lines.append(f"  {f.name:<18} {getattr(c, f.name):>12g}  <- {SOURCES[f.name]}")
    lines.append("one shard group's ring per step (3 collectives), by where its spare came from:")
    lines.append(f"  {'spare from':<12} " + " ".join(f"{t + ' GB':>12}" for t in TIERS) + f" {'comm s':>8} {'step s':>8} {'vs near':>8}")
    near = step_for_tier(c, "nvlink")
    for t in TIERS:
        g = step_for_tier(c, t)
        lines.append(f"  {t:<12} " + " ".join(f"{g.bytes_per_tier[x] / 1e9:>12,.1f}" for x in TIERS)
                     + f" {g.comm_seconds:>8.3f} {g.step_seconds:>8.3f} {g.step_seconds / near.step_seconds:>7.2f}x")
    outs = {pol: spare_monte_carlo(c, p, pol, runs, seed) for pol in ("nearest", "random")}
    def memory_tier(q: goodput.Params) -> goodput.Summary:
        return goodput.run(q, runs=ettr_runs, seed=seed, strategies=("sentinel_memory_spare",))["sentinel_memory_spare"]

    base = memory_tier(p).ettr_mean
    cross, same = memory_tier(replace(p, placement="cross_domain")), memory_tier(replace(p, placement="adjacent"))
    ring_share, plan_share = same_rack_share_of_plans(c)
    lines.append(f"side by side ({runs} runs of {p.days:g} days; ETTR = Sentinel + memory tier + warm spare):")
    lines.append(f"  {'choice':<36} {'off-NVLink GB/step':>18} {'ETTR':>8} {'P(double failure)':>18}  notes")
    for pol, label in (("nearest", "spare: nearest (Sentinel)"), ("random", "spare: first waiting (random)")):
        o = outs[pol]
        crossing = sum(o.share_by_tier[t] * sum(v for k, v in step_for_tier(c, t).bytes_per_tier.items() if k != "nvlink")
                       for t in TIERS)
        lines.append(f"  {label:<36} {crossing / 1e9:>18.1f} {base * o.ettr_factor:>8.5f} {'':>18}  spares from "
                     + ", ".join(f"{t} {o.share_by_tier[t]:.1%}" for t in TIERS) + f"; job slowed {o.slow_hours:.0f} h")
    for placement, label, ettr, share in (("cross_domain", "replica: another rack (Sentinel)", cross, plan_share),
                                          ("adjacent", "replica: same rack ((n+1) mod N)", same, ring_share)):
        q = replace(p, placement=placement)
        lines.append(f"  {label:<36} {'':>18} {ettr.ettr_mean:>8.5f} {goodput.double_failure_probability(q):>18.2e}  "
                     f"{share:.1%} of replicas in the holder's rack; {ettr.fallbacks_mean:.1f} restarts from disk per run")
    return "\n".join(lines)


def summary_lines(p: goodput.Params, runs: int = 5, seed: int = 0) -> list[str]:
    """Two lines for ``sentinel simulate goodput``: what a far spare and a same-rack replica cost."""
    c = Cluster(gpus=p.gpus)
    near, far = step_for_tier(c, "nvlink"), step_for_tier(c, "spine")
    outs = {pol: spare_monte_carlo(c, p, pol, runs, seed) for pol in ("nearest", "random")}
    same = goodput.double_failure_probability(replace(p, placement="adjacent"))
    cross = goodput.double_failure_probability(replace(p, placement="cross_domain"))
    return [f"placement: a spare outside the NVLink domain makes a step {far.step_seconds / near.step_seconds:.2f}x as long "
            f"(GB200 NVL72 model, `sentinel simulate placement`); ETTR factor nearest spare {outs['nearest'].ettr_factor:.4f} "
            f"vs random {outs['random'].ettr_factor:.4f}",
            f"placement: P(both replica holders lost | sudden node loss) same rack {same:.2e} vs another rack {cross:.2e}"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    base = Cluster()
    for f in fields(Cluster):
        flag = "--" + f.name.replace("_", "-")
        ap.add_argument(flag, type=type(getattr(base, f.name)), default=getattr(base, f.name),
                        help=SOURCES.get(f.name, "cluster size"))
    ap.add_argument("--days", type=float, default=30.0)
    ap.add_argument("--preset", choices=sorted(goodput.PRESETS), default="llama3", help="failure rate preset")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ettr-runs", type=int, default=5, help="goodput runs per replica placement")
    ap.add_argument("--seed", type=int, default=0)


def main_args(args: argparse.Namespace) -> int:
    try:
        c = Cluster(**{f.name: getattr(args, f.name) for f in fields(Cluster)})
        p = goodput.Params(gpus=c.gpus, days=args.days, rate_per_node_day=goodput.PRESETS[args.preset])
    except ValueError as exc:
        print(f"sentinel simulate placement: {exc}", file=sys.stderr)
        return 2
    if args.runs < 1 or args.ettr_runs < 1:
        print("sentinel simulate placement: --runs and --ettr-runs must be >= 1", file=sys.stderr)
        return 2
    print(report(c, p, args.runs, args.seed, args.ettr_runs))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sentinel simulate placement")
    add_arguments(ap)
    return main_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
