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
import _report  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CHUNK_MB = 16
REF_MODES = ("none", "memcpy", "disk", "memory", "memory+disk")
BIG_MODES = ("none", "memcpy", "memory")
LABELS = {"none": "no snapshots", "memcpy": "plain copy of the shard (memcpy)",
          "disk": "disk-only guard, async DCP every step", "memory": "memory tier every step",
          "memory+disk": "memory tier every step + disk every 10"}


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
        guards = {}
        for mode in cfg["modes"]:
            if mode == "disk":
                guards[mode] = SnapshotGuard(snapdir / mode, make_state(), interval_steps=1, keep=1)
            elif mode.startswith("memory"):
                guards[mode] = SnapshotGuard(snapdir / mode, make_state(), memory_interval_steps=1,
                                             interval_steps=10 if mode == "memory+disk" else 0, keep=1,
                                             memory_dir=holder / mode / node, memory_run_id=f"{cfg['run_id']}-{mode}")
        # the memory+disk guard counts from 5: its disk snapshot falls mid-block, and its write
        # runs while that block is timed
        counters = {m: (5 if m == "memory+disk" else 0) for m in cfg["modes"]}
        times: dict[str, list[float]] = {m: [] for m in cfg["modes"]}
        per_round: dict[str, dict[int, list[float]]] = {}
        copies: list[float] = []
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        modes, step = list(cfg["modes"]), 0
        warm: dict[str, tuple[int, int]] = {}  # per memory guard: (stalls, replica copies) in round 0
        for r in range(cfg["rounds"]):
            if r == 1:
                warm = {m: (len(g.memory.stalls), len(g.memory.replicator.seconds) if g.memory.replicator else 0)
                        for m, g in guards.items() if g.memory is not None}
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                for _ in range(cfg["block"]):
                    t0 = time.perf_counter()
                    train_step(step)
                    if mode == "memcpy":
                        if not src:  # once: the optimizer state exists after the first step
                            src = shard()
                            dst = [torch.empty_like(t) for t in src]
                        c0 = time.perf_counter()
                        for d, s in zip(dst, src):
                            d.copy_(s)
                        if r > 0:
                            copies.append(time.perf_counter() - c0)
                    elif mode in guards:
                        guards[mode].step(counters[mode])
                        counters[mode] += 1
                    dist.barrier()  # one step = the slowest rank's step
                    if r > 0:
                        times[mode].append(time.perf_counter() - t0)
                        per_round.setdefault(mode, {}).setdefault(r, []).append(time.perf_counter() - t0)
                    step += 1
                for g in guards.values():
                    g.drain()
                dist.barrier()
        mine = {"times": times, "copies": copies, "memory": {}}
        for mode, g in guards.items():
            if g.memory is not None:
                m = g.memory
                n, nr = warm.get(mode, (0, 0))  # round 0 is the warm-up, as for the step times
                mine["memory"][mode] = {"summary": g.memory_summary(), "stalls": m.stalls[n:],
                                        "parts": {k: v[n:] for k, v in m.stall_parts.items()},
                                        "replica_seconds": m.replicator.seconds[nr:] if m.replicator else []}
        for g in guards.values():
            g.close()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            out["times"] = {m: median(everyone[0]["times"][m]) for m in cfg["modes"]}  # barrier: same on every rank
            # the load of this shared VM drifts: each round's modes ran in adjacent blocks, so the
            # ratio to "none" within a round is the robust figure; its median over rounds is reported
            rounds = sorted(per_round["none"])
            out["ratios"] = {m: sorted(median(per_round[m][r]) / median(per_round["none"][r]) for r in rounds)
                             for m in cfg["modes"]}
            out["memcpy"] = median([c for e in everyone for c in e["copies"]])
            mem = {}
            for mode in everyone[0]["memory"]:
                per = [e["memory"][mode] for e in everyone]
                mem[mode] = {
                    "stall": median([s for p in per for s in p["stalls"]]),
                    "parts": {k: median([x for p in per for x in p["parts"][k]]) for k in per[0]["parts"]},
                    "replica": median([x for p in per for x in p["replica_seconds"]]),
                    "snapshots": sum(p["summary"]["snapshots"] for p in per) // world,
                    "late": sum(p["summary"]["late"] for p in per) // world,
                    "held_bytes": per[0]["summary"]["held_bytes"],
                }
            out["memory"] = mem
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


def print_timing(title: str, res: dict, modes: tuple[str, ...]) -> dict[str, float]:
    print(title)
    print(f"  {'mode':<42} {'step ms':>8} {'vs none':>8} {'(rounds)':>17} {'stall ms':>9} {'stall/memcpy':>13} {'late':>9}")
    for mode in modes:
        t = res["times"][mode]
        rs = res["ratios"][mode]
        spread = f"{(rs[0] - 1) * 100:+.0f}..{(rs[-1] - 1) * 100:+.0f}%"
        m = res["memory"].get(mode)
        stall = m["stall"] if m else (res["memcpy"] if mode == "memcpy" else None)
        ratio = f"{stall / res['memcpy']:.2f}" if stall is not None and mode != "memcpy" else ""
        late = f"{m['late']}/{m['late'] + m['snapshots']}" if m else ""
        print(f"  {LABELS[mode]:<42} {t * 1e3:>8.2f} {(median(rs) - 1) * 100:>+7.1f}% {spread:>17} "
              f"{'' if stall is None else f'{stall * 1e3:.3f}':>9} {ratio:>13} {late:>9}")
    for mode, m in res["memory"].items():
        parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in m["parts"].items() if v is not None)
        copy = "n/a" if m["replica"] is None else f"{m['replica'] * 1e3:.1f} ms"
        print(f"  {mode}: stall parts (ms): {parts}; replica copy {copy} (background); "
              f"{m['held_bytes'] / 2**20:.1f} MiB held per rank")
    print("  (vs none: median over rounds of each round's ratio to the no-snapshot blocks of that round;"
          " the range in parentheses)")


SMOKE_FIGURES = (
    "reference_step_seconds", "reference_disk_every_step_overhead_fraction", "memory_snapshot_overhead_fraction",
    "memory_with_disk_every_10_overhead_fraction", "reference_memcpy_overhead_fraction", "reference_memory_stall_seconds",
    "reference_memcpy_seconds", "reference_stall_to_memcpy_ratio", "reference_memory_late_fraction", "big_state_bytes",
    "big_memcpy_seconds", "big_stall_seconds", "big_stall_to_memcpy_ratio", "big_memory_snapshot_overhead_fraction",
    "big_memcpy_overhead_fraction", "big_replica_copy_seconds", "big_memory_late_fraction",
    "restore_from_memory_seconds", "restore_from_peer_seconds", "restore_from_disk_seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11, help="rounds of blocks (round 0 is warm-up)")
    ap.add_argument("--block", type=int, default=8, help="steps per mode per round")
    ap.add_argument("--big-mb", type=int, default=256)
    ap.add_argument("--big-rounds", type=int, default=5)
    ap.add_argument("--big-block", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="reference job model width")
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.block, args.big_mb, args.big_rounds, args.big_block, args.dim = 2, 1, 16, 2, 1, 32
    if args.rounds < 2 or args.big_rounds < 2 or args.block < 1 or args.big_block < 1:
        ap.error("--rounds and --big-rounds must be >= 2 (round 0 is warm-up), --block and --big-block >= 1")
    holders = Path(tempfile.mkdtemp(prefix="sentinel-bench-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="sentinel-bench-"))
    figures: dict[str, float | None] = {}
    pid = os.getpid()
    results = _report.Results(args.json, "memory_tier", lambda _runs: figures)

    def save(part: str) -> None:  # each part written as it finishes
        results.add({"part": part})
    try:
        ref = run(4, 2, phase="timing", modes=REF_MODES, rounds=args.rounds, block=args.block, big_mb=0,
                  dim=args.dim, holders=str(holders / "ref"), snapdir=str(work / "ref"), run_id=f"bench-ref-{pid}")
        steps = (args.rounds - 1) * args.block
        print_timing(f"reference FSDP2 job, 2 nodes x 2 ranks (gloo, CPU): medians of {steps} steps per mode, "
                     f"interleaved in blocks of {args.block}", ref, REF_MODES)
        base = ref["times"]["none"]
        m = ref["memory"]["memory"]
        figures.update(reference_step_seconds=base,
                       reference_disk_every_step_overhead_fraction=median(ref["ratios"]["disk"]) - 1,
                       memory_snapshot_overhead_fraction=median(ref["ratios"]["memory"]) - 1,
                       memory_with_disk_every_10_overhead_fraction=median(ref["ratios"]["memory+disk"]) - 1,
                       reference_memcpy_overhead_fraction=median(ref["ratios"]["memcpy"]) - 1,
                       reference_memory_stall_seconds=m["stall"], reference_memcpy_seconds=ref["memcpy"],
                       reference_stall_to_memcpy_ratio=m["stall"] / ref["memcpy"],
                       reference_memory_late_fraction=m["late"] / max(1, m["late"] + m["snapshots"]))
        save("reference")

        mb = args.big_mb
        big = run(2, 1, phase="timing", modes=BIG_MODES, rounds=args.big_rounds, block=args.big_block, big_mb=mb,
                  dim=args.dim, holders=str(holders / "big-timing"), snapdir=str(work / "big-timing"),
                  run_id=f"bench-big-{pid}")
        print()
        print_timing(f"{mb} MB per rank, 2 nodes x 1 rank: medians of {(args.big_rounds - 1) * args.big_block} steps "
                     f"per mode, interleaved in blocks of {args.big_block}", big, BIG_MODES)
        b = big["memory"]["memory"]
        figures.update(big_state_bytes=mb * 2**20, big_memcpy_seconds=big["memcpy"], big_stall_seconds=b["stall"],
                       big_stall_to_memcpy_ratio=b["stall"] / big["memcpy"],
                       big_memory_snapshot_overhead_fraction=median(big["ratios"]["memory"]) - 1,
                       big_memcpy_overhead_fraction=median(big["ratios"]["memcpy"]) - 1,
                       big_replica_copy_seconds=b["replica"],
                       big_memory_late_fraction=b["late"] / max(1, b["late"] + b["snapshots"]))
        save("big")

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
        save("restore")
    finally:
        shutil.rmtree(holders, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    results.finish()

if __name__ == "__main__":
    main()
