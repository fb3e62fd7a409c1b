"""Why torch elastic + DCP and NVRx (DDP jobs) do not end bitwise equal to their own uninterrupted
runs at 2 nodes x 2 ranks, while the same loop without DDP does: run under torchrun,

    torchrun --standalone --nproc-per-node 4 bench/peer_jobs/ddp_resume.py

It trains the peers' model (bench/peer_jobs/common.py) for 20 steps three ways in one process
group and prints whether the final parameters are equal:
  uninterrupted: one DDP for all 20 steps;
  restarted at step k: the state after k steps (parameters and AdamW state, copied as a checkpoint
  would) in a fresh model, optimizer and DDP for the remaining steps: what every restart does;
  --no-ddp: the same, with each parameter's gradient all-reduced on its own.
Measured on torch 2.13.0 CPU, gloo: with 2 ranks all equal; with 3 or 4 ranks the DDP restart
differs (k = 10 and k = 1) and the per-parameter one is equal. A fresh DDP's first step reduces its
gradients in buckets laid out in registration order, later steps in the order the gradients became
ready (DDP rebuilds its buckets after the first iteration), and gloo's allreduce sums each element
of a bucket in an order set by its offset: with 3+ ranks float addition's grouping changes.
Nothing is lost or torn; the run after a restart is a different but equally valid float sum.
``--find-unused`` (DDP(find_unused_parameters=True), which never rebuilds its buckets) makes the DDP
restart equal too: the proof that the rebuild is the cause, and a setting a user who wants bitwise
restarts can choose (at the cost of a graph traversal per step).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench.peer_jobs import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-ddp", action="store_true", help="all-reduce each parameter's gradient on its own")
    ap.add_argument("--find-unused", action="store_true", help="DDP(find_unused_parameters=True): no bucket rebuild")
    ap.add_argument("--steps", type=int, default=20)
    opts = ap.parse_args()
    args = common.parser("").parse_args(["--progress", "/dev/null"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def wrap(model):
        return model if opts.no_ddp else DDP(model, find_unused_parameters=opts.find_unused)

    def train(model, optim, wrapped, lo, hi):
        for step in range(lo, hi):
            x, y = common.batch(args, step, rank, world)
            common.loss_of(wrapped, args, x, y).backward()
            if opts.no_ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            optim.step()
            optim.zero_grad(set_to_none=True)

    def run(restart_at: int) -> str:
        model, optim = common.build_model(args)
        train(model, optim, wrap(model), 0, restart_at)
        if restart_at < opts.steps:
            params = {k: v.clone() for k, v in model.state_dict().items()}
            state = copy.deepcopy(optim.state_dict())
            model, optim = common.build_model(args)
            model.load_state_dict(params)
            optim.load_state_dict(state)
            train(model, optim, wrap(model), restart_at, opts.steps)
        return common.digest(model)

    want = run(opts.steps)
    got = {k: run(k) == want for k in (opts.steps // 2, 1)}
    if rank == 0:
        print(f"world {world}, {'per-parameter all-reduce' if opts.no_ddp else 'DDP'}"
              f"{' (find_unused_parameters)' if opts.find_unused else ''}: "
              + ", ".join(f"restarted at step {k} {'equal' if eq else 'NOT equal'}" for k, eq in got.items())
              + " to the uninterrupted run", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
