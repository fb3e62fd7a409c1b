"""A plain Lightning training script, as one writes it without Sentinel, plus one line.

The one line is ``SentinelCallback(...)`` in ``callbacks=[...]`` (marked below); everything else
is stock Lightning: a LightningModule with dropout, AdamW and a StepLR schedule, a map-style
DataLoader with shuffling (Lightning gives it a DistributedSampler), a validation loop at each epoch's end, ``seed_everything``, DDP,
and Lightning's own ``ModelCheckpoint`` every 10 steps. Launch it as any Lightning job under
torchelastic:

    sentinel launch -- python -m trainer.elastic --preload lightning.pytorch -- \\
        --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        examples/lightning_job.py --num-nodes 2 --devices 1 --max-steps 60 --root /shared/run
"""

import argparse

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.integrations.lightning import SentinelCallback


class Regressor(L.LightningModule):
    def __init__(self, dim: int = 32, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).squeeze(-1), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset(n: int = 256, dim: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, generator=g) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=60)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--root", default="lightning_run")
    args = ap.parse_args()

    L.seed_everything(1234, workers=True)
    model = Regressor()
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    val_loader = DataLoader(dataset(64, seed=1), batch_size=16)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy="ddp",
        max_steps=args.max_steps, default_root_dir=args.root, deterministic=True,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=f"{args.root}/checkpoints", every_n_train_steps=10, save_top_k=-1),
                   SentinelCallback(f"{args.root}/sentinel")],  # <- the one line Sentinel adds
    )
    trainer.fit(model, loader, val_loader)


if __name__ == "__main__":
    main()
