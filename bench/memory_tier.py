"""The memory tier, side by side in one run (medians):

  1. the reference FSDP2 job (2 nodes x 2 ranks, gloo, CPU). One job runs every mode in turn, in
     blocks of ``--block`` steps, the order rotating each round (round 0 is warm-up): no
     snapshots; a plain copy of each rank's shard into a preallocated buffer (the memcpy the
     stall is compared with); today's disk-only guard snapshotting every step (async DCP); a
     memory snapshot every step (own node + peer replica); the same with a disk snapshot every
     10 steps written from memory. A step is train + guard + a barrier (the slowest rank). Each
     guard's background work is drained between blocks, so none spills into another mode.
  2. a larger state per rank (default 256 MB; 2 nodes x 1 rank), the same way: no snapshots,
     memcpy, memory snapshot every step. The stall is the time the training loop is held by a
     snapshot (state dict + copy + header); its parts are printed. When a replica copy outlasts
     a step, the next memory snapshots are late (skipped, counted), never the step.
  3. restore of that state (a new job each, like a restart): from the node's own memory, from the
     peer's replica (the node's memory wiped) and from disk (both wiped), each the whole
     ``guard.resume()``. The snapshots come from a 9-step job with memory every step and disk
     every 3 (due at steps 2, 5 and 8: the last one is written even when the previous write or a
     replica copy is still running then).

Each "node" holds its memory in its own directory under /dev/shm.

    python bench/memory_tier.py [--rounds 6] [--block 8] [--big-mb 256] [--json out.json] [--smoke]

``--smoke``: 2 rounds of 1-step blocks, 16 MB per rank. The JSON is rewritten after each of the
three parts, so a run cut short keeps the parts that finished.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer.shutdown import then_destroy_process_groups  # noqa: E402
import _like  # noqa: E402
import _report  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CHUNK_MB = 16

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@then_destroy_process_groups  # its objects gone, the groups' threads are joined (trainer.shutdown)
def worker(rank: int, world: int, per_node: int, port: int, cfg: dict, out: dict) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from trainer.guard import ModelOptimState, SnapshotGuard
    from trainer.memory.layout import local, walk

    if cfg["big_mb"]:
        n = max(1, cfg["big_mb"] // CHUNK_MB)
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(CHUNK_MB * 2**20 // 4, generator=g) for _ in range(n)]

        def make_state() -> dict:
            return {"big": {f"w{i}": p for i, p in enumerate(params)}}

        def train_step(step: int) -> None:
            for p in params:  # touch every byte, as an optimizer step does
                p.mul_(0.999)

        def shard() -> list[torch.Tensor]:
            return params
    else:
        import torch.nn as nn
        from torch.distributed.fsdp import fully_shard

        from trainer.train import TinyTransformer, batch_for

        torch.manual_seed(1234)
        model = TinyTransformer(256, cfg["dim"], 2, 4)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()

        def make_state() -> dict:
            return {"app": ModelOptimState(model, optim)}

        def train_step(step: int) -> None:
            x, y = batch_for(step, 1234, 8, 32, 256, rank, world)
            loss_fn(model(x).reshape(-1, 256), y.reshape(-1)).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)

        def shard() -> list[torch.Tensor]:  # what a memory snapshot copies: local shards, optimizer state
            sd = ModelOptimState(model, optim).state_dict()  # its tensors are the live ones (in place)
            return [local(v) for _, v in walk(sd) if isinstance(v, torch.Tensor)]

    holder = Path(cfg["holders"])
    node = f"node{rank // per_node}"
    snapdir = Path(cfg["snapdir"])
    if cfg["phase"] == "timing":
        selected = tuple(m for m in _like.modes(cfg["interval"]) if m.name in cfg["modes"])
        guards = _like.make_guards(selected, make_state, snapdir, holder, node, cfg["run_id"])
        mine = _like.run_blocks(selected, guards, cfg["rounds"], cfg["block"], train_step, shard)
        for g in guards.values():
            g.close()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            out.update(_like.combine(selected, everyone))
    else:  # "prepare": memory every step + disk every 3, the last disk snapshot owed at close; "restore*"
        kw = dict(memory_interval_steps=1, memory_dir=holder / node, memory_run_id=cfg["run_id"], keep=2)
        guard = SnapshotGuard(snapdir, make_state(), interval_steps=3 if cfg["phase"] == "prepare" else 0, **kw)
        t0 = time.perf_counter()
        start = guard.resume()
        resume_seconds = time.perf_counter() - t0
        for step in range(start, start + cfg["steps"]):
            train_step(step)
            guard.step(step)
            if cfg["phase"] == "prepare":
                # a step at least as long as the replica copy (as in a real job with a big state),
                # so that the last memory snapshot is replicated and the peer restore has it
                guard.memory.wait_idle()
        guard.close()  # writes the disk snapshot still owed (due while the previous write ran)
        if rank == 0:
            from trainer.guard import complete_snapshots

            out.update(resume_seconds=resume_seconds, start=start, restore=guard.restore_summary(),
                       disk_steps=[s for s, _ in complete_snapshots(snapdir)],
                       records=[(r.step, r.tier, r.ok) for r in guard.records])



def run(world: int, per_node: int, **cfg) -> dict:
    """One job of ``world`` ranks, each a new process (a restore is a restart). Forked from this
    process, which has imported torch and touched no tensor: a rank does not import torch again
    (seconds per rank on a loaded host), and every figure is timed inside the ranks."""
    with mp.get_context("fork").Manager() as manager:
        out = manager.dict()
        mp.start_processes(worker, args=(world, per_node, free_port(), cfg, out), nprocs=world, join=True,
                           start_method="fork")
        return dict(out)


def _verdict(k1: dict) -> str:
    """Whether the K = 1 overhead is under 5 % beyond the rounds' noise: the upper end of the
    median's 95 % confidence interval, not the median alone."""
    ci = k1["overhead_ci95"]
    if ci is None:
        return f" over {len(k1['ratios'])} rounds: too few for a 95 % interval (6 or more)"
    return (f", 95 % CI {ci[0] * 100:+.1f}..{ci[1] * 100:+.1f}% over {len(k1['ratios'])} rounds: "
            + ("under 5 % beyond noise" if ci[1] <= 0.05 else "not shown under 5 %"))


def like_figures(prefix: str, res: dict, per_gb: float | None = None) -> dict[str, float | None]:
    """``<prefix>_<mode>_<what>``: each strategy's figures, measured the same way (bench/_like.py);
    with ``per_gb`` (10^9 / state bytes per rank) per GB of state instead of per snapshot."""
    out: dict[str, float | None] = {}
    scale, unit = (per_gb, "_per_gb") if per_gb else (1.0, "")
    for name, r in res["rows"].items():
        if name == "none":
            continue
        out[f"{prefix}_{name}_overhead_fraction"] = r["overhead"]
        if name == "memcpy":
            out[f"{prefix}_memcpy_seconds"] = r["stall"]
            continue
        if name == "guard":
            continue
        for what in ("stall", "cost", "background_cpu", "training_cpu"):
            v = r[what]
            out[f"{prefix}_{name}_{what}_seconds{unit}"] = None if v is None else v * scale
    return out


SMOKE_FIGURES = (
    "reference_step_seconds", "memory_snapshot_overhead_fraction", "memory_over_async_cost_ratio",
    "like_interval_steps", "like_memory_cost_seconds", "like_async_cost_seconds", "like_sync_cost_seconds",
    "like_memory_k1_stall_seconds", "like_memory_background_cpu_seconds", "like_async_background_cpu_seconds",
    "like_memory_k1_disk_overhead_fraction", "like_memcpy_seconds", "reference_state_bytes",
    "reference_memory_late_fraction", "big_state_bytes", "big_memcpy_seconds", "big_stall_seconds",
    "big_stall_to_memcpy_ratio", "big_memory_snapshot_overhead_fraction", "big_replica_copy_seconds",
    "big_memory_stall_seconds_per_gb", "big_memory_background_cpu_seconds_per_gb", "big_async_stall_seconds_per_gb",
    "big_async_background_cpu_seconds_per_gb", "big_memory_late_fraction",
    "restore_from_memory_seconds", "restore_from_peer_seconds", "restore_from_disk_seconds")
PARTS = ("reference", "big", "restore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11, help="rounds of blocks (round 0 is warm-up)")
    ap.add_argument("--block", type=int, default=8, help="steps per mode per round")
    ap.add_argument("--big-mb", type=int, default=256)
    ap.add_argument("--big-rounds", type=int, default=5)
    ap.add_argument("--big-block", type=int, default=8)
    ap.add_argument("--interval", type=int, default=4, help="steps between snapshots of the strategies compared")
    ap.add_argument("--big-interval", type=int, default=8, help="the same, for the large state")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    ap.add_argument("--modes", nargs="+", choices=[m.name for m in _like.modes(1)],
                    help="the reference job's strategies (default: all; none, memory_k1, memory and async are needed "
                         "for the summary figures)")
    ap.add_argument("--dim", type=int, default=64, help="reference job model width")
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.block, args.big_mb, args.big_rounds, args.big_block, args.dim = 2, 2, 16, 2, 2, 32
        args.interval = args.big_interval = 2
    if args.rounds < 2 or args.big_rounds < 2 or args.block < 1 or args.big_block < 1:
        ap.error("--rounds and --big-rounds must be >= 2 (round 0 is warm-up), --block and --big-block >= 1")
    if args.interval < 1 or args.big_interval < 1 or args.block % args.interval or args.big_block % args.big_interval:
        ap.error("--block must be a multiple of --interval, --big-block of --big-interval (each block the same "
                 "number of snapshots)")
    holders = Path(tempfile.mkdtemp(prefix="sentinel-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="sentinel-bench-"))
    figures: dict[str, float | None] = {}
    pid = os.getpid()
    results = _report.Results(args.json, "memory_tier", lambda _runs: figures)

    def save(part: str) -> None:  # each part written as it finishes
        results.add({"part": part})
    try:
        if "reference" in args.parts:
            reference(args, figures, holders, work, pid)
            save("reference")
        if "big" in args.parts:
            big(args, figures, holders, work, pid)
            save("big")
        if "restore" in args.parts:
            restore(args, figures, holders, work, pid)
            save("restore")
    finally:
        shutil.rmtree(holders, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    results.finish()


def reference(args: argparse.Namespace, figures: dict, holders: Path, work: Path, pid: int) -> None:
    selected = tuple(m for m in _like.modes(args.interval) if not args.modes or m.name in args.modes or m.name == "none")
    ref = run(4, 2, phase="timing", modes=[m.name for m in selected], interval=args.interval,
              rounds=args.rounds, block=args.block, big_mb=0, dim=args.dim, holders=str(holders / "ref"),
              snapdir=str(work / "ref"), run_id=f"bench-ref-{pid}")
    steps = (args.rounds - 1) * args.block
    _like.print_rows(f"reference FSDP2 job, 2 nodes x 2 ranks (gloo, CPU), every strategy at the same interval "
                     f"({args.interval} steps) and K = 1: medians of {steps} steps per mode, interleaved in blocks of "
                     f"{args.block}; load {_loadavg()}", ref, selected)
    rows = ref["rows"]
    if not {"memory_k1", "memory", "async"} <= set(rows):
        return
    k1, mem, disk = rows["memory_k1"], rows["memory"], rows["async"]
    _stall_parts("memory_k1", k1)
    cont = _like.contention(rows)
    ratio = mem["cost"] / disk["cost"] if mem["cost"] is not None and disk["cost"] else None
    print(f"  memory tier every {args.interval} / async disk every {args.interval}, wall-clock cost per snapshot: "
          + ("n/a" if ratio is None else f"{ratio:.2f}x") + " (target <= 0.5x); K = 1 overhead "
          f"{k1['overhead'] * 100:+.1f}% (target <= 5 %)" + _verdict(k1))
    print(f"  this machine: 1 CPU-second of background work cost the step "
          + ("n/a" if cont is None else f"{cont:.2f}") + " wall-clock seconds (2 cores, 4 ranks)")
    summary = k1["summary"] or {}
    ci = k1["overhead_ci95"] or (None, None)
    figures.update(memory_snapshot_overhead_ci95_low_fraction=ci[0], memory_snapshot_overhead_ci95_high_fraction=ci[1],
                   memory_snapshot_overhead_rounds_count=len(k1["ratios"]))
    figures.update(reference_step_seconds=ref["base"], memory_snapshot_overhead_fraction=k1["overhead"],
                   memory_over_async_cost_ratio=ratio, like_interval_steps=args.interval,
                   reference_contention_ratio=cont, reference_state_bytes=summary.get("state_bytes"),
                   reference_memory_late_fraction=k1["late"] / max(1, k1["late"] + k1["snapshots"]),
                   reference_replica_skipped_fraction=k1["replica_skipped"] / max(1, k1["snapshots"]),
                   **like_figures("like", ref))


def big(args: argparse.Namespace, figures: dict, holders: Path, work: Path, pid: int) -> None:
    mb = args.big_mb
    names = ("none", "memcpy", "memory_k1", "memory", "async")
    res = run(2, 1, phase="timing", modes=names, interval=args.big_interval, rounds=args.big_rounds,
              block=args.big_block, big_mb=mb, dim=args.dim, holders=str(holders / "big-timing"),
              snapdir=str(work / "big-timing"), run_id=f"bench-big-{pid}")
    print()
    _like.print_rows(f"{mb} MB per rank, 2 nodes x 1 rank, at {args.big_interval} steps and K = 1: medians of "
                     f"{(args.big_rounds - 1) * args.big_block} steps per mode, interleaved in blocks of "
                     f"{args.big_block}; load {_loadavg()}", res, tuple(m for m in _like.modes(args.big_interval)
                                                                        if m.name in names))
    rows = res["rows"]
    k1 = rows["memory_k1"]
    _stall_parts("memory_k1", k1)
    memcpy = rows["memcpy"]["stall"]
    figures.update(big_state_bytes=mb * 2**20, big_memcpy_seconds=memcpy, big_stall_seconds=k1["stall"],
                   big_stall_to_memcpy_ratio=k1["stall"] / memcpy if k1["stall"] and memcpy else None,
                   big_memory_snapshot_overhead_fraction=k1["overhead"],
                   big_replica_copy_seconds=rows["memory"]["replica_seconds"],
                   big_memory_late_fraction=k1["late"] / max(1, k1["late"] + k1["snapshots"]),
                   **{k: v for k, v in like_figures("big", {"rows": {n: rows[n] for n in ("memory", "async")}},
                                                    per_gb=1e9 / (mb * 2**20)).items() if k.endswith("_per_gb")})


def _stall_parts(name: str, row: dict) -> None:
    s = row["summary"] or {}
    parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in (s.get("stall_parts_median_seconds") or {}).items()
                      if v is not None)
    copy = "n/a" if row["replica_seconds"] is None else f"{row['replica_seconds'] * 1e3:.1f} ms"
    print(f"  {name}: stall parts (ms, rank 0): {parts}; replica round {copy} (background); "
          f"{(s.get('held_bytes') or 0) / 2**20:.1f} MiB held per rank")


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def restore(args: argparse.Namespace, figures: dict, holders: Path, work: Path, pid: int) -> None:
    mb = args.big_mb
    bh, bs, rid = holders / "big", work / "big", f"bench-big-restore-{pid}"
    common = dict(big_mb=mb, dim=args.dim, holders=str(bh), snapdir=str(bs), run_id=rid)
    prep = run(2, 1, phase="prepare", steps=9, **common)
    own = run(2, 1, phase="restore", steps=0, **common)
    shutil.rmtree(bh / "node1")
    peer = run(2, 1, phase="restore", steps=0, **common)
    shutil.rmtree(bh)
    disk = run(2, 1, phase="restore", steps=0, **common)
    tiers = (own["restore"]["tier"], peer["restore"]["tier"], disk["restore"]["tier"])
    print()
    print(f"restore of {mb} MB per rank (whole guard.resume())   {'own memory':>11} {'peer replica':>13} {'disk':>8}")
    r_own, r_peer, r_disk = own["resume_seconds"], peer["resume_seconds"], disk["resume_seconds"]
    print(f"  {'seconds':<47} {r_own:>11.3f} {r_peer:>13.3f} {r_disk:>8.3f}")
    print(f"  {'vs own memory':<47} {1:>10.1f}x {r_peer / r_own:>12.1f}x {r_disk / r_own:>7.1f}x")
    print(f"  {'resumed at step':<47} {own['start']:>11} {peer['start']:>13} {disk['start']:>8}")
    print(f"  tiers: {tiers[0]}, {tiers[1]} (shards from a peer: {peer['restore'].get('peer')}), {tiers[2]}; "
          f"disk snapshots left by the 9-step job (disk due at steps 2, 5, 8; keep 2): {sorted(prep['disk_steps'])}")
    ok = tiers == ("memory", "memory", "disk") and peer["restore"].get("peer")
    if not ok:
        print("note: a restore did not come from the tier it measures; its figure is left out (null)")
    figures.update(restore_from_memory_seconds=r_own if tiers[0] == "memory" else None,
                   restore_from_peer_seconds=r_peer if tiers[1] == "memory" and peer["restore"].get("peer") else None,
                   restore_from_disk_seconds=r_disk if tiers[2] == "disk" else None)


if __name__ == "__main__":
    main()
