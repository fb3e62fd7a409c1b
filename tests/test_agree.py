"""trainer.agree: the guard's dissemination MAX gives every rank what gloo's all_reduce(MAX) gives, for
world sizes that are and are not powers of two, agreement after agreement with no barrier between
them, while the same group's asynchronous collectives (the progress exchange's) are in flight."""

from __future__ import annotations

import random
import socket
import time
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


GROUP_TIMEOUT = 6.0


def _rank_beside_a_lost_one(rank: int, world: int, port: int, how: str, out: dict) -> None:
    import os

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT))
    agree_max([rank], group, world)  # every pair connected: the loss is mid-job, not at setup
    if rank == world - 1:
        if how == "dead":
            os._exit(0)
        while len(out) < world - 1:  # alive, never agreeing (stopped, swapped out): the sockets stay open
            time.sleep(0.1)
        os._exit(0)
    t0 = time.monotonic()
    try:
        agree_max([rank], group, world)
        out[rank] = ("agreed without the lost rank", time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - what the group raises is the result
        out[rank] = (type(exc).__name__, time.monotonic() - t0)
    os._exit(0)  # destroy_process_group would wait on the lost rank


@pytest.mark.parametrize("how", ["dead", "hung"])
def test_a_lost_rank_ends_every_other_ranks_agreement_within_the_groups_timeout(how):
    """A rank gone (its sockets closed) or hung (its sockets open, never sending) mid-job: every other
    rank's agreement raises, and within about the group's timeout: each round's wait has the
    group's timeout and a failure is never a late success that starts another full wait."""
    world = 5
    with mp.get_context("fork").Manager() as manager:
        out = manager.dict()
        ctx = mp.start_processes(_rank_beside_a_lost_one, args=(world, _port(), how, out), nprocs=world,
                                 join=False, start_method="fork")
        try:
            deadline = time.monotonic() + 10 * GROUP_TIMEOUT
            while not ctx.join(timeout=1):
                assert time.monotonic() < deadline, f"ranks still waiting: {dict(out)}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        got = dict(out)
    assert sorted(got) == list(range(world - 1))
    for rank, (result, seconds) in got.items():
        assert result != "agreed without the lost rank", rank
        assert seconds < 2 * GROUP_TIMEOUT, (rank, result, seconds)
