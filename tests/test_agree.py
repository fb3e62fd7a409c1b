"""trainer.agree: the guard's dissemination MAX gives every rank what gloo's all_reduce(MAX) gives, for
world sizes that are and are not powers of two, agreement after agreement with no barrier between
them, while the same group's asynchronous collectives (the progress exchange's) are in flight."""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.agree import MaxAgreement, agree_max

ROUNDS = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=60))
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        rng = random.Random(rank)
        mismatches = []
        for i in range(ROUNDS):
            mine = [rng.randrange(-1000, 1000) for _ in range(4)]
            side = torch.tensor([float(rank)])  # a collective of the same group in flight meanwhile
            work = dist.all_reduce(side, group=group, async_op=True) if i % 3 == 0 else None
            pending = MaxAgreement(torch.tensor(mine), group, world)
            got = pending.wait().tolist()
            if work is not None:
                work.wait()
            want = torch.tensor(mine)
            dist.all_reduce(want, op=dist.ReduceOp.MAX)  # the default group: the reference
            if got != want.tolist() or agree_max([rank, -rank], group, world) != [world - 1, 0]:
                mismatches.append(i)
        out[rank] = mismatches
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_every_rank_gets_the_max_of_every_rank_agreement_after_agreement(world):
    with mp.get_context("fork").Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(world, _port(), out), nprocs=world, join=True, start_method="fork")
        assert dict(out) == {r: [] for r in range(world)}


def test_one_rank_needs_no_group():
    assert agree_max([3, -1], None, 1) == [3, -1]
