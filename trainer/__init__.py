"""The PyTorch side of Sentinel: snapshot on the daemon's request, agreed by all ranks.

    guard = SnapshotGuard(ckpt_dir, {"app": ModelOptimState(model, optim)})
    start = guard.resume()
    for step in range(start, total_steps):
        train_step(step)
        guard.step(step)
"""

from trainer.guard import ModelOptimState, NodeDrained, SnapshotGuard, complete_snapshots

__all__ = ["SnapshotGuard", "ModelOptimState", "NodeDrained", "complete_snapshots"]
