"""What every peer's training job shares (bench/peers.py): the reference model and data of
trainer/train.py, the step log the harness reads, and the final digest.

The model is trainer.train's TinyTransformer with its defaults (dim 64, 2 layers, 4 heads, vocab
256, seq 32, global batch 8), seeded the same way; the batch of global step s is trainer.train's
``batch_for(seed, s)``, sliced by the data-parallel rank. So every system trains the same model on
the same data in the same order; what differs is how it wraps the model (DDP here, FSDP2 in
trainer.train) and what it does when a process dies.

Progress lines (JSON, one per line, O_APPEND so many processes can share the file):
``{"event": "step", "step": s, "time": t, "writer": w, "participants": n, "compute": c}`` once per
committed step by the writer (the job's rank 0; for torchft every replica group's rank 0), plus
``started``, ``resumed`` (with the step it resumes from) and ``finished`` (with the digest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import time
from pathlib import Path

import torch
import torch.nn as nn

from trainer.train import TinyTransformer, batch_for

# the harness injects rank-crash through this file: the named rank raises at the named step
CRASH_FILE_ENV = "PEERS_CRASH_FILE"


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="pad each step to this duration")
    ap.add_argument("--progress", required=True, help="append progress lines here")
    ap.add_argument("--final", default="", help="rank 0 writes the final digest here")
    ap.add_argument("--ckpt-dir", default="", help="checkpoint directory (systems that write one)")
    ap.add_argument("--interval-steps", type=int, default=5, help="checkpoint every K steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    return ap


def build_model(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """trainer.train's model with the same seed, unsharded, and the same optimizer."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    model = TinyTransformer(args.vocab, args.dim, args.layers, args.heads)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(args: argparse.Namespace, step: int, dp_rank: int, dp_world: int):
    return batch_for(step, args.seed, args.global_batch, args.seq, args.vocab, dp_rank, dp_world)


def loss_of(model: nn.Module, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), y.reshape(-1))


def digest(model: nn.Module) -> str:
    """SHA-256 of the parameters (names sorted), as trainer.train.state_digests hashes them."""
    h = hashlib.sha256()
    sd = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    for name in sorted(sd):
        h.update(("." + name).encode())
        h.update(sd[name].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class Log:
    """The progress file; every line carries the writer, pid, node and time."""

    def __init__(self, path: str, writer: str) -> None:
        self.path, self.writer = path, writer
        self.node = os.environ.get("PEERS_NODE", socket.gethostname())

    def __call__(self, event: str, **fields) -> None:
        line = {"event": event, "writer": self.writer, "node": self.node, "pid": os.getpid(), "time": time.time(),
                **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def maybe_crash(step: int, rank: int, log: "Log") -> None:
    """rank-crash: raise in the rank and at the step the harness wrote into PEERS_CRASH_FILE
    ("rank step"), once (the file is removed first, so a restarted rank does not raise again)."""
    path = os.environ.get(CRASH_FILE_ENV, "")
    if not path or not os.path.exists(path):
        return
    try:
        want_rank, want_step = (int(v) for v in Path(path).read_text().split())
    except (OSError, ValueError):
        return
    if rank == want_rank and step >= want_step:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return  # another process of this rank took it
        log("fault", step=step, rank=rank, fault="rank-crash")
        raise RuntimeError(f"injected rank-crash: rank {rank} raises at step {step}")


def pad(t0: float, step_seconds: float) -> None:
    left = step_seconds - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def finish(log: Log, args: argparse.Namespace, model: nn.Module, **fields) -> None:
    d = digest(model)
    log("finished", params=d, **fields)
    if args.final:
        Path(args.final).write_text(json.dumps({"params": d, "steps": args.steps, **fields}))
