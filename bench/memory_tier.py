"""The memory tier, side by side in one run (medians):

  1. step time of the reference FSDP2 job (2 nodes x 2 ranks, gloo) with no snapshots, with
     today's disk-only guard snapshotting every step (async DCP), and with a memory snapshot
     every step (own node + peer replica; disk every 10 steps, written from memory);
  2. for a larger state per rank (default 256 MB; 2 nodes x 1 rank): the stall of a memory
     snapshot against a plain memcpy of the same bytes into a preallocated buffer, and the step
     overhead at K = 1;
  3. restore time of that state from the node's own memory, from the peer's replica (the node's
     memory wiped) and from disk (both wiped).

Each "node" holds its memory in its own directory under /dev/shm.

    python bench/memory_tier.py [--steps 40] [--big-mb 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CHUNK_MB = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, per_node: int, port: int, cfg: dict, out: dict) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    from trainer.guard import ModelOptimState, SnapshotGuard

    if cfg["big_mb"]:
        n = max(1, cfg["big_mb"] // CHUNK_MB)
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(CHUNK_MB * 2**20 // 4, generator=g) for _ in range(n)]
        state = {"big": {f"w{i}": p for i, p in enumerate(params)}}

        def train_step(step: int) -> None:
            for p in params:  # touch every byte, as an optimizer step does
                p.mul_(0.999)
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
        state = {"app": ModelOptimState(model, optim)}
        loss_fn = nn.CrossEntropyLoss()

        def train_step(step: int) -> None:
            x, y = batch_for(step, 1234, 8, 32, 256, rank, world)
            loss_fn(model(x).reshape(-1, 256), y.reshape(-1)).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)

    mode = cfg["mode"]
    holder = Path(cfg["holders"]) / f"node{rank // per_node}"
    kw = {}
    if mode == "memory":
        kw = dict(memory_interval_steps=1, memory_dir=holder, memory_run_id=cfg["run_id"], interval_steps=cfg["disk_every"])
    elif mode == "disk":
        kw = dict(interval_steps=1, keep=1)
    guard = SnapshotGuard(cfg["snapdir"], state, **kw) if mode != "none" else None
    t0 = time.perf_counter()
    start = guard.resume() if guard is not None and cfg.get("resume") else 0
    resume_seconds = time.perf_counter() - t0
    times = []
    for step in range(start, start + cfg["steps"]):
        t0 = time.perf_counter()
        train_step(step)
        if guard is not None:
            guard.step(step)
        dist.barrier()  # one step = the slowest rank's step
        times.append(time.perf_counter() - t0)
    memcpy = []
    if cfg["big_mb"]:
        flat = [torch.empty_like(p) for p in params]
        for _ in range(5):
            t0 = time.perf_counter()
            for dst, src in zip(flat, params):
                dst.copy_(src)
            memcpy.append(time.perf_counter() - t0)
    if guard is not None and guard.memory is not None:
        guard.memory.wait_idle()
    summary = guard.memory_summary() if guard is not None else None
    info = guard.restore_summary() if guard is not None else {}
    stalls = sorted(guard.memory.stalls[1:] or guard.memory.stalls) if guard is not None and guard.memory is not None else []
    if guard is not None:
        guard.close()
    if rank == 0:
        warm = times[2:] if len(times) > 4 else times
        out.update(step=statistics.median(warm), memory=summary, restore=info, resume_seconds=resume_seconds,
                   stall=statistics.median(stalls) if stalls else None,
                   memcpy=statistics.median(memcpy[1:]) if memcpy else None)
    dist.destroy_process_group()


def run(world: int, per_node: int, **cfg) -> dict:
    out = mp.Manager().dict()
    mp.spawn(worker, args=(world, per_node, free_port(), cfg, out), nprocs=world, join=True)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--big-mb", type=int, default=256)
    ap.add_argument("--big-steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64, help="reference job model width")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    holders = Path(tempfile.mkdtemp(prefix="sentinel-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="sentinel-bench-"))
    figures: dict[str, float] = {}
    try:
        ref = {}
        for mode in ("none", "disk", "memory"):  # the reference job, 2 nodes x 2 ranks
            ref[mode] = run(4, 2, mode=mode, steps=args.steps, big_mb=0, dim=args.dim, holders=str(holders / mode),
                            snapdir=str(work / f"ref-{mode}"), run_id=f"bench-ref-{os.getpid()}", disk_every=10)
        print("reference FSDP2 job, 2 nodes x 2 ranks (gloo, CPU), medians of", args.steps, "steps")
        print(f"{'guard':<46} {'step ms':>8} {'overhead':>9}")
        base = ref["none"]["step"]
        for mode, label in (("none", "no snapshots"), ("disk", "disk-only guard, async DCP every step"),
                            ("memory", "memory tier every step (+ disk every 10)")):
            over = ref[mode]["step"] / base - 1
            print(f"{label:<46} {ref[mode]['step'] * 1e3:>8.2f} {over * 100:>8.1f}%")
        mem = ref["memory"]["memory"]
        print(f"  memory tier: {mem['snapshots']} snapshots, {mem['late']} late, {mem['held_bytes'] / 2**20:.1f} MiB "
              f"held per rank, stall median {mem['stall_median_seconds'] * 1e3:.2f} ms")
        figures.update(reference_step_seconds=base, reference_disk_every_step_overhead_fraction=ref["disk"]["step"] / base - 1,
                       memory_snapshot_overhead_fraction=ref["memory"]["step"] / base - 1,
                       reference_memory_stall_seconds=mem["stall_median_seconds"])

        big = {}
        rid = f"bench-big-{os.getpid()}"
        bh = holders / "big"
        for mode in ("none", "memory"):
            big[mode] = run(2, 1, mode=mode, steps=args.big_steps, big_mb=args.big_mb, holders=str(bh),
                            snapdir=str(work / "big"), run_id=rid, disk_every=2, dim=args.dim)
        own = run(2, 1, mode="memory", steps=1, big_mb=args.big_mb, holders=str(bh), snapdir=str(work / "big"),
                  run_id=rid, disk_every=0, dim=args.dim, resume=True)
        shutil.rmtree(bh / "node1")
        peer = run(2, 1, mode="memory", steps=1, big_mb=args.big_mb, holders=str(bh), snapdir=str(work / "big"),
                   run_id=rid, disk_every=0, dim=args.dim, resume=True)
        shutil.rmtree(bh)
        disk = run(2, 1, mode="memory", steps=1, big_mb=args.big_mb, holders=str(bh), snapdir=str(work / "big"),
                   run_id=rid, disk_every=0, dim=args.dim, resume=True)
        b = big["memory"]
        mb = args.big_mb
        print()
        print(f"{mb} MB per rank, 2 nodes x 1 rank")
        print(f"{'':<28} {'memcpy ms':>10} {'stall ms':>9} {'stall/memcpy':>13} {'step ms (none)':>15} {'step ms (K=1)':>14} {'overhead':>9}")
        over = b["step"] / big["none"]["step"] - 1
        print(f"{'memory snapshot every step':<28} {b['memcpy'] * 1e3:>10.1f} {b['stall'] * 1e3:>9.1f} "
              f"{b['stall'] / b['memcpy']:>13.2f} {big['none']['step'] * 1e3:>15.1f} {b['step'] * 1e3:>14.1f} {over * 100:>8.1f}%")
        print()
        print(f"restore of {mb} MB per rank   {'own memory':>11} {'peer replica':>13} {'disk':>8}")
        r_own, r_peer, r_disk = own["restore"].get("seconds"), peer["restore"].get("seconds"), disk["resume_seconds"]
        print(f"{'seconds':<28} {r_own:>11.3f} {r_peer:>13.3f} {r_disk:>8.3f}   (tiers: {own['restore']['tier']}, "
              f"{peer['restore']['tier']} {peer['restore'].get('peer')}, {disk['restore']['tier']})")
        print(f"{'vs own memory':<28} {1:>11.1f}x {r_peer / r_own:>12.1f}x {r_disk / r_own:>7.1f}x")
        figures.update({f"big_state_bytes": mb * 2**20, "big_memcpy_seconds": b["memcpy"], "big_stall_seconds": b["stall"],
                        "big_stall_to_memcpy_ratio": b["stall"] / b["memcpy"],
                        "big_memory_snapshot_overhead_fraction": over,
                        "restore_from_memory_seconds": r_own, "restore_from_peer_seconds": r_peer,
                        "restore_from_disk_seconds": r_disk})
        if (own["restore"]["tier"], peer["restore"]["tier"], disk["restore"]["tier"]) != ("memory", "memory", "disk"):
            print("note: a restore did not come from the tier it measures (see 'tiers' above); its figure is not valid")
    finally:
        shutil.rmtree(holders, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "memory_tier", "version": 1,
                                               "created": datetime.now(timezone.utc).isoformat(),
                                               "host": {"cpus": os.cpu_count()}, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
