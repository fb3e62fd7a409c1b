"""NVIDIA Resiliency Extension 0.4.1, in-process restart (``inprocess.Wrapper``), configured as its
guide and optimal_example.py have a user do it: the training function is wrapped; the model and
optimizer are built once, outside it, and kept in memory across restarts; every process of the
job (the active ranks and the warm spares) is started up front; a rank that dies is replaced by
a spare (``Compose(MaxActiveWorldSize(N), FillGaps())``), the survivors restart the wrapped
function in the same process, and the state of active rank 0 (a survivor: the victim is never
node 0) is broadcast to every active rank, so nothing is recomputed.

Docs followed:
  https://nvidia.github.io/nvidia-resiliency-ext/inprocess/usage_guide.html   (Wrapper, CallWrapper, PrefixStore per iteration)
  https://github.com/NVIDIA/nvidia-resiliency-ext/blob/main/examples/inprocess/optimal_example.py
  health_check=None: the default CudaHealthCheck needs a GPU; on CPU gloo there is none to check.

Started directly (not under torchrun: the guide says torchrun's agent kills all local workers
when one dies, which defeats in-process restart): RANK, WORLD_SIZE (active + spares),
MASTER_ADDR, MASTER_PORT per process; ``--active N`` is the training world. (No ``from __future__
import annotations`` here: the Wrapper finds its CallWrapper parameter by the annotation's class.)
"""

import datetime
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import nvidia_resiliency_ext.inprocess as inprocess  # noqa: E402

from bench.peer_jobs import common  # noqa: E402

ARGS = common.parser(__doc__.split("\n\n")[0])
ARGS.add_argument("--active", type=int, default=4, help="active ranks; the rest are warm spares")
ARGS.add_argument("--heartbeat-timeout", type=float, default=30.0, help="Wrapper heartbeat_timeout (s), its default")


def train(base_store, model, optim, state: dict, args, call_wrapper: Optional[inprocess.CallWrapper] = None):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = common.Log(args.progress, f"rank{rank}")
    store = dist.PrefixStore(str(call_wrapper.iteration), base_store)  # a fresh namespace per restart
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optim.zero_grad(set_to_none=True)  # the interrupted step's partial gradients are not the next step's
    # the live state of active rank 0 (model, optimizer, next step) to every rank: a spare that
    # took a dead rank's place has only its initial state
    with torch.no_grad():
        for t in [*model.parameters(), *_optim_tensors(optim)]:
            dist.broadcast(t, 0)
    nxt = torch.tensor([state["step"]])
    dist.broadcast(nxt, 0)
    state["step"] = int(nxt)
    log("resumed", rank=rank, start=state["step"], source="memory", iteration=call_wrapper.iteration)
    while state["step"] < args.steps:
        step = state["step"]
        common.maybe_crash(step, rank, log)
        t0 = time.perf_counter()
        x, y = common.batch(args, step, rank, world)
        loss = common.loss_of(ddp, args, x, y)
        loss.backward()
        with call_wrapper.atomic():  # a restart never lands between the update and the counter
            optim.step()
            optim.zero_grad(set_to_none=True)
            state["step"] = step + 1
        if rank == 0:
            log("step", step=step, participants=world, compute=round(time.perf_counter() - t0, 6),
                loss=round(loss.item(), 6))
        call_wrapper.ping()
        common.pad(t0, args.step_seconds)
    if rank == 0:
        common.finish(log, args, model, world=world, rss=common.peak_rss_bytes())
    dist.destroy_process_group()


def _optim_tensors(optim) -> list[torch.Tensor]:
    """AdamW's state tensors in parameter order (created by a zero step if this rank has none:
    a spare that never stepped)."""
    if not optim.state:
        for p in optim.param_groups[0]["params"]:
            optim.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return [optim.state[p][k] for p in optim.param_groups[0]["params"] for k in ("step", "exp_avg", "exp_avg_sq")]


def main() -> int:
    args = ARGS.parse_args()
    model, optim = common.build_model(args)
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(os.environ["MASTER_ADDR"], port + 1, int(os.environ["WORLD_SIZE"]),
                               is_master=int(os.environ["RANK"]) == 0, multi_tenant=True, wait_for_workers=True,
                               use_libuv=True)
    common.Log(args.progress, f"initial{os.environ['RANK']}")("started", rank=int(os.environ["RANK"]))
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": port + 2},
        health_check=None,
        rank_assignment=inprocess.Compose(inprocess.rank_assignment.MaxActiveWorldSize(args.active),
                                          inprocess.rank_assignment.FillGaps()),
        heartbeat_timeout=datetime.timedelta(seconds=args.heartbeat_timeout),
    )(train)
    wrapped(base_store, model, optim, {"step": 0}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
