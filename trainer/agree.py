"""The guard's per-step agreement: the element-wise MAX of a few integers over every rank.

gloo's ``all_reduce`` runs a ring: 2 x (world - 1) message hops one after another, each a wake-up
of another process (measured on the 4-rank reference job on this 2-core VM: 7.5 ms against 4.1 ms
for what follows, ranks arriving up to 4 ms apart; at 16,384 ranks a ring is 32,766 hops a step).
MAX is idempotent, so a *dissemination* exchange gives every rank the result in ceil(log2(world))
rounds: in round k each rank sends what it holds to ``rank + 2^k`` and takes the MAX with what
``rank - 2^k`` sent it; after the last round every rank has seen every rank's values (a value seen
twice changes no MAX). The messages are point-to-point on the given group (gloo keeps them apart
from that group's collectives, which may be in flight: the progress exchange), in program order
on every pair of ranks, so consecutive agreements never mix.

:class:`MaxAgreement` posts the first round when made and finishes in :meth:`MaxAgreement.wait`:
what the caller does in between (the memory tier's own copy) runs while the slowest rank arrives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class MaxAgreement:
    """``vec`` (a small integer tensor, replaced in place by the element-wise MAX over every rank of
    ``group`` once :meth:`wait` returns). ``group`` None: the default group; ``world`` 1: no messages."""

    def __init__(self, vec: torch.Tensor, group: Any, world: int) -> None:
        self.vec = vec
        self.group = group
        self.world = world
        self.rank = dist.get_rank(group) if world > 1 else 0
        self._step = 1
        self._works: list[Any] = []
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None
        if world > 1:
            self._post()

    def _peer(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _post(self) -> None:
        out, into = self.vec.clone(), torch.empty_like(self.vec)  # the send's buffer is never written meanwhile
        self._bufs = (out, into)
        k = self._step
        self._works = [dist.irecv(into, src=self._peer((self.rank - k) % self.world), group=self.group),
                       dist.isend(out, dst=self._peer((self.rank + k) % self.world), group=self.group)]

    def wait(self) -> torch.Tensor:
        """The MAX over every rank (raises what the group raises: a peer gone, the group's timeout)."""
        while self._works:
            for w in self._works:
                w.wait()
            assert self._bufs is not None
            torch.maximum(self.vec, self._bufs[1], out=self.vec)
            self._works = []
            self._step *= 2
            if self._step < self.world:
                self._post()
        return self.vec


def agree_max(values: list[int], group: Any, world: int) -> list[int]:
    """The element-wise MAX of ``values`` over every rank of ``group`` (collective: every rank calls it)."""
    return MaxAgreement(torch.tensor(values, dtype=torch.int64), group, world).wait().tolist()
