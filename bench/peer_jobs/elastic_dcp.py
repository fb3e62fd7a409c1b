"""torch elastic + DCP, as its documentation has a user set it up: torchrun with --max-restarts and
a c10d rendezvous restarts every worker when one fails (or when a node leaves and a new one
joins); the job resumes from its last complete DCP checkpoint, written every K steps with
``dcp.async_save`` (the save runs in a thread; the step waits only for the staging).

Docs followed:
  https://docs.pytorch.org/docs/stable/elastic/train_script.html   (resume from a checkpoint on every (re)start)
  https://docs.pytorch.org/docs/stable/elastic/run.html            (--max-restarts, c10d rendezvous)
  https://docs.pytorch.org/tutorials/recipes/distributed_async_checkpoint_recipe.html  (async_save, one save in flight)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the harness sets it (torch 2.13's shared rendezvous store
  hands the restarted workers the dead workers' addresses: gloo "connectFullMesh ... Connection refused").

``--no-ft`` is the same loop with no checkpoint and no restart: the steady-state baseline.

    torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d ... \
        bench/peer_jobs/elastic_dcp.py --progress P --ckpt-dir D --interval-steps 5
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from bench.peer_jobs import common  # noqa: E402


class AppState:
    """The model, optimizer and next step as one DCP Stateful (the recipe's shape)."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "step": self.step}

    def load_state_dict(self, sd) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def latest(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint: DCP writes .metadata last."""
    done = [p for p in ckpt_dir.glob("step_*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--no-ft", action="store_true", help="no checkpoints, no restarts: the baseline")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 as trainer.train shards it (Sentinel's baseline)")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = common.Log(args.progress, f"rank{rank}")
    log("started", rank=rank, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    model, optim = common.build_model(args)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        ddp = fully_shard(model)
    else:
        ddp = DDP(model)
    state = AppState(ddp, optim)
    ckpt = Path(args.ckpt_dir) if args.ckpt_dir and not args.no_ft else None
    src = latest(ckpt) if ckpt else None
    if src is not None:
        sd = {"app": state}
        dcp.load(sd, checkpoint_id=str(src))
    log("resumed", rank=rank, start=state.step, source=str(src or ""))
    # the save's own collectives run in its thread: on a group of their own (the recipe's
    # checkpoint process group), never interleaved with DDP's allreduces on the default one
    ckpt_pg = dist.new_group(backend="gloo") if ckpt is not None else None
    pending = None
    for step in range(state.step, args.steps):
        common.maybe_crash(step, rank, log)
        t0 = time.perf_counter()
        x, y = common.batch(args, step, rank, world)
        loss = common.loss_of(ddp, args, x, y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        compute = time.perf_counter() - t0
        state.step = step + 1
        if ckpt is not None and state.step % args.interval_steps == 0:
            if pending is not None:
                pending.result()  # one save in flight, as the recipe says
            # the staging copy: on a GPU async_save copies the state to host memory before it returns;
            # CPU tensors it would write while the next steps change them (a torn checkpoint)
            staged = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state.state_dict())
            pending = dcp.async_save({"app": staged}, checkpoint_id=str(ckpt / f"step_{state.step}"),
                                     process_group=ckpt_pg)
        if rank == 0:
            log("step", step=step, participants=world, compute=round(compute, 6), loss=round(loss.item(), 6),
                stall=round(time.perf_counter() - t0 - compute, 6))
        common.pad(t0, args.step_seconds)
    if pending is not None:
        pending.result()
    dist.barrier()  # every rank is done before rank 0 reports
    if not args.fsdp and rank == 0:  # (FSDP's shards: the baseline's digest is not compared)
        common.finish(log, args, model, world=world, rss=common.peak_rss_bytes())
    elif rank == 0:
        log("finished", world=world)
    # no teardown: a rank whose group's store (rank 0's worker, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    # is gone could wait in destroy_process_group for minutes (seen here); the work is written
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
