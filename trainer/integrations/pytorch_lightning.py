"""``SentinelCallback`` for scripts on the older ``pytorch_lightning`` namespace (the ``lightning``
distribution installs it too): the same callback as :mod:`trainer.integrations.lightning`, derived
from ``pytorch_lightning.Callback`` so that such a ``Trainer`` takes it as its own."""

from __future__ import annotations

import pytorch_lightning as pl

from trainer.integrations.lightning import LightningState, _SentinelHooks


class SentinelCallback(_SentinelHooks, pl.Callback):
    """``pytorch_lightning.Trainer(callbacks=[SentinelCallback(snapshot_dir)])``: see
    :mod:`trainer.integrations.lightning`."""


__all__ = ["SentinelCallback", "LightningState"]
