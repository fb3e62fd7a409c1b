"""TorchTitan's checkpointing path on CPU: torchtitan's own CheckpointManager (here Sentinel's
subclass of it), OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader, called
the way torchtitan's ``Trainer.train`` calls them (``checkpointer.load`` once, then per step:
forward/backward, ``optimizers.step``, ``lr_schedulers.step``, ``checkpointer.save(step,
last_step=...)``), driving a model that trains on CPU: Sentinel's reference transformer under
FSDP2 on gloo.

Why not ``torchtitan.train`` itself on CPU: TorchTitan 0.3.0 imports triton for its MoE kernels
(``torchtitan.distributed.minimal_async_ep.kernels``), picks ``cuda`` as its device, and none of its
attention backends has a CPU backward (flex: "FlexAttention does not support backward on CPU";
sdpa refused for its language models; varlen needs flash kernels). The full run with its debug
model is ``scripts/torchtitan-gpu-check`` for a machine with a GPU.

    torchrun --nproc-per-node 2 examples/torchtitan_job.py --steps 40 --root /tmp/titan
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from trainer.integrations.progress import ProgressRecord, write_final
from trainer.integrations.torchtitan import SentinelCheckpointManager
from trainer.train import TinyTransformer, state_digests

VOCAB, SEQ, DIM = 256, 32, 64


class TokenStream(IterableDataset, Stateful):
    """This rank's deterministic token stream: sample i is a function of (seed, rank, i) only;
    its position is its state (the data loader saves it)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank, self.i = seed, rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 100_003 + self.i)
            self.i += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield tokens[:-1], tokens[1:]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state_dict):
        self.i = state_dict["i"]


class TrainState(Stateful):
    """torchtitan's ``train_state``: the step (its Trainer saves itself under that key)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--root", default="titan_run")
    ap.add_argument("--interval", type=int, default=10, help="torchtitan's own checkpoint interval")
    ap.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--stop-after", type=int, default=0, help="stop after this step without a last save (tests)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    record = ProgressRecord.from_env(rank=rank, world=world)
    record("admitted")
    torch.manual_seed(args.seed)
    model = TinyTransformer(VOCAB, DIM, 2, 4)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(optimizers=optimizers, training_steps=args.steps)
    dataloader = ParallelAwareDataloader(TokenStream(args.seed, rank), dp_rank=rank, dp_world_size=world, batch_size=4)
    train_state = TrainState()
    checkpointer = SentinelCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=args.interval, async_mode=args.async_mode, keep_latest_k=3,
        last_save_model_only=False,
        migrate_hold_seconds=float(os.environ.get("SENTINEL_MIGRATE_HOLD_SECONDS", "180")),
    ).build(dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": train_state}, sd_adapter=None, base_folder=args.root)

    checkpointer.load(step=-1)  # as torchtitan's Trainer.train: the newest checkpoint, or a fresh start
    start = train_state.step
    record("resumed", start=start + 1, source=str(checkpointer.guard.resumed_from or ""),
           restore=checkpointer.guard.restore_summary())
    pad = float(os.environ.get("SENTINEL_DRILL_STEP_SECONDS", "0") or 0)
    loss_fn = nn.CrossEntropyLoss()
    data = iter(dataloader)
    while train_state.step < args.steps:
        t0 = time.perf_counter()
        train_state.step += 1
        x, y = next(data)
        loss = loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        lr_schedulers.step()
        if rank == 0:
            record("step", step=train_state.step, loss=round(loss.item(), 6))
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        time.sleep(max(0.0, pad - (time.perf_counter() - t0)))
        if train_state.step == args.stop_after:
            break
    checkpointer.maybe_wait_for_saving()
    summary = checkpointer.guard.summary()
    checkpointer.close()
    digests = state_digests(model, optimizers.optimizers)
    if rank == 0:
        write_final(digests, steps=args.steps, world=world, resumed_at=start + 1, guard=summary)
        record("finished", **digests)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
