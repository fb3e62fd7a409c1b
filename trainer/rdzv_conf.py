"""``--rdzv-conf`` values of the slot rendezvous (:mod:`trainer.slot_rendezvous`,
:mod:`trainer.etcd_rendezvous`): checked where they enter, with the key named in the error."""

from __future__ import annotations

import math

from torch.distributed.elastic.rendezvous.api import RendezvousParameters


def seconds(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={raw!r}: not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:  # nan would make every deadline never pass
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be a finite number > 0")
    return value


def count(params: RendezvousParameters, key: str, default: int) -> int:
    raw = params.get(key, default)
    text = str(raw).strip()
    if isinstance(raw, bool) or not text.isdigit() or len(text) > 6 or int(text) < 1:
        raise ValueError(f"--rdzv-conf {key}={raw!r}: must be a whole number >= 1")
    return int(text)
