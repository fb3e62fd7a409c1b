"""The reference FSDP2 job with the memory tier, every "node" (``--ranks-per-node`` ranks) holding
its memory in its own directory under ``--holders`` — several nodes on one host, for the tests.

    torchrun --standalone --nproc-per-node 4 tests/workers/memory_job.py --holders D --run-id R ...

``--exit-at S``: every rank leaves at once (os._exit, no cleanup) after step S — a crash that
leaves each node's memory behind. Writes one JSON line per rank to ``--out`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from trainer.guard import ModelOptimState, SnapshotGuard
from trainer.shutdown import then_destroy_process_groups
from trainer.train import TinyTransformer, batch_for, state_digests


@then_destroy_process_groups  # its objects gone, the groups' threads are joined (trainer.shutdown)
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--holders", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--snapshot-dir", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval-steps", type=int, default=0)
    ap.add_argument("--memory-interval-steps", type=int, default=1)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--exit-at", type=int, default=-1)
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank's replica copy is throttled")
    ap.add_argument("--slow-bytes-per-second", type=float, default=20_000.0)
    ap.add_argument("--hold-copies", action="store_true",
                    help="--slow-rank's replica copies wait until the last step is done (a partner that never "
                         "keeps up, whatever the load on this host: every memory snapshot after the first is late)")
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--slow-disk-seconds", type=float, default=0.0,
                    help="every disk snapshot write takes this much longer (a slow shared filesystem)")
    ap.add_argument("--hold-disk-step", type=int, default=-1,
                    help="the disk snapshot of this step is held until the last step is done (a filesystem that "
                         "stalls, whatever the load on this host: the next one due finds it still running)")
    ap.add_argument("--migrate-ack", choices=("durable", "memory"), default="durable")
    ap.add_argument("--migrate-hold-seconds", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=180))  # --hold-copies: peers wait in a receive
    disk_released = threading.Event()
    if args.slow_disk_seconds > 0 or args.hold_disk_step >= 0:
        import torch.distributed.checkpoint as dcp

        save = dcp.save

        def slow_save(*a, **kw):
            if str(kw.get("checkpoint_id", "")).endswith(f"step-{args.hold_disk_step:09d}"):
                disk_released.wait(120)
            time.sleep(args.slow_disk_seconds)
            return save(*a, **kw)

        dcp.save = slow_save
    rank, world = dist.get_rank(), dist.get_world_size()
    copies_released = threading.Event()
    if args.hold_copies and rank == args.slow_rank:
        from trainer.memory.replicator import Replicator

        exchange = Replicator._exchange

        def held(self, pairs):
            copies_released.wait(120)
            return exchange(self, pairs)

        Replicator._exchange = held
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(1234)
    model = TinyTransformer(256, 64, 2, 4)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    holder = Path(args.holders) / f"node{rank // args.ranks_per_node}"
    guard = SnapshotGuard(args.snapshot_dir, {"app": ModelOptimState(model, optim)},
                          interval_steps=args.interval_steps, memory_interval_steps=args.memory_interval_steps,
                          memory_dir=holder, memory_run_id=args.run_id, local_world_size=args.ranks_per_node,
                          migrate_ack=args.migrate_ack, migrate_hold_seconds=args.migrate_hold_seconds,
                          replica_bytes_per_second=args.slow_bytes_per_second if rank == args.slow_rank else 0.0)
    start = guard.resume()
    loss_fn = nn.CrossEntropyLoss()
    step_times = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = batch_for(step, 1234, 8, 32, 256, rank, world)
        loss = loss_fn(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        guard.step(step)
        step_times.append(time.perf_counter() - t0)
        if step == args.exit_at:
            if guard.memory is not None:
                guard.memory.wait_idle()  # a crash right after a replicated snapshot (tests pick the moment)
            os._exit(17)
        pad = args.step_seconds - (time.perf_counter() - t0)
        if pad > 0:
            time.sleep(pad)
    copies_released.set()
    disk_released.set()
    guard.close()  # writes a disk snapshot still owed at the end: the summary comes after it
    summary = {"rank": rank, "start": start, "restore": guard.restore_summary(), "memory": guard.memory_summary(),
               "resumed_from": str(guard.resumed_from or ""), "max_step_seconds": max(step_times, default=0.0),
               "records": [{"step": r.step, "tier": r.tier, "ok": r.ok} for r in guard.records]}
    summary.update(state_digests(model, optim))
    with open(args.out, "a") as f:
        f.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
