"""Reference job: a small transformer under FSDP2, launched by torchrun, with SnapshotGuard.

Deterministic: seeded init, and the data of global step s is a function of (seed, s) alone, so a
resumed run is bitwise equal to an uninterrupted one at the same world size. gloo on CPU, NCCL
on GPU.

    torchrun --nproc-per-node 2 -m trainer.train --steps 50 --snapshot-dir /tmp/snap
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

# When this worker started, stamped by the process itself before it imports torch: a cold worker
# pays its torch import after it; a worker forked from a warm forkserver runs this module afresh
# (runpy), so this is the moment of its fork. Same clock as every other progress event, to the
# microsecond (what /proc's start time is not: boot time in whole seconds plus clock ticks).
PROCESS_STARTED = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trainer.guard import DEFAULT_MIGRATE_HOLD_SECONDS, ModelOptimState, NodeDrained, SnapshotGuard  # noqa: E402
from trainer.shutdown import destroy_process_groups  # noqa: E402


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch_for(step: int, seed: int, global_batch: int, seq: int, vocab: int, rank: int, world: int):
    """The global batch of ``step`` depends on (seed, step) only; each rank takes its slice."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    per = global_batch // world
    part = tokens[rank * per:(rank + 1) * per]
    return part[:, :-1], part[:, 1:]


def _flatten(prefix: str, obj, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = obj


def state_digests(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of the full (unsharded) parameters and of the full optimizer state (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {}
    for label, sd in (("params", msd), ("optim", osd)):
        flat: dict = {}
        _flatten("", sd, flat)
        h = hashlib.sha256()
        for name in sorted(flat):
            h.update(name.encode())
            v = flat[name]
            h.update(v.detach().contiguous().cpu().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
        out[label] = h.hexdigest()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--snapshot-dir", required=True)
    ap.add_argument("--interval-steps", type=int, default=0, help="periodic snapshots every N steps (0: only on request)")
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="pad each step to this duration (drills)")
    ap.add_argument("--migrate-hold-seconds", type=float, default=DEFAULT_MIGRATE_HOLD_SECONDS,
                    help="hold after a migrate snapshot at least this long (a request may ask for longer)")
    ap.add_argument("--memory-interval-steps", type=int, default=0,
                    help="in-memory snapshot (own node + a peer replica) every N steps (0: off)")
    ap.add_argument("--migrate-ack", choices=("durable", "memory"), default="durable",
                    help="acknowledge a migrate snapshot once on disk too (durable) or once in memory and "
                         "replicated (memory: the drain starts sooner; two adjacent victims fall back to disk)")
    ap.add_argument("--replica-bytes-per-second", type=float, default=0.0,
                    help="throttle the peer replica copy (0: as fast as it goes)")
    ap.add_argument("--progress", help="append one JSON line per computed step (rank 0)")
    ap.add_argument("--final", help="write the final parameters' digest here (rank 0)")
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout (s): a hung peer is noticed only then")
    return ap


def build_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seeded model, each layer and the whole sharded with FSDP2, and its optimizer."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    model = TinyTransformer(args.vocab, args.dim, args.layers, args.heads).to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, loss_fn: nn.Module, args: argparse.Namespace,
               step: int, device: torch.device) -> torch.Tensor:
    """One optimizer step on global step ``step``'s batch (this rank's slice); the loss."""
    x, y = batch_for(step, args.seed, args.global_batch, args.seq, args.vocab, dist.get_rank(), dist.get_world_size())
    x, y = x.to(device), y.to(device)
    logits = model(x)
    loss = loss_fn(logits.reshape(-1, args.vocab), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss


class _GuardLog:
    """Called after every step: one progress line per snapshot the guard finished, one per window
    the progress exchange scored (each node's compute seconds: what a drill judges a straggler's
    hand-over by), and the memory tier's replica placement once it is agreed (at its first
    snapshot); rank 0 writes them."""

    def __init__(self, guard: SnapshotGuard, rank: int, record) -> None:
        self.guard, self.rank, self.record = guard, rank, record
        self.reported = 0
        self.placed = False
        self.window = None

    def __call__(self) -> None:
        g = self.guard
        for rec in g.records[self.reported:]:
            if self.rank == 0:
                self.record("snapshot", step=rec.step, ok=rec.ok, kind=rec.kind, path=rec.path, error=rec.error[:200])
        self.reported = len(g.records)
        window = g.watch.last_window
        if window is not self.window and self.rank == 0:
            self.record("exchange", step=window[0], compute={n: round(c, 6) for n, c in window[1].items()},
                        stragglers=list(window[2]), links={n: round(c, 6) for n, c in g.watch.last_links.items()},
                        link_stragglers=[s.node for s in g.watch.link_stragglers])
        self.window = window
        if not self.placed and self.rank == 0 and g.memory is not None and g.memory.placement:
            self.record("replica_placement", placement=g.memory.placement)
            self.placed = True


class _DrillFault:
    """Drills only (``sentinel drill --fault hang/slow``): a file the drill writes into this node's
    runtime directory. ``skip``: local rank 0 never enters the step's collectives (stuck before
    them, as in a data loader or a deadlock of its own); ``slow=F``: every step takes F times as
    long. Called before the step's clock starts, so the step padding cannot absorb the slowdown.
    One stat() per step when the variable is set."""

    def __init__(self, path: str, local_rank: int, step_seconds: float, record) -> None:
        self.path, self.local_rank, self.step_seconds, self.record = path, local_rank, step_seconds, record

    def __call__(self, step: int) -> None:
        if not self.path or not os.path.exists(self.path):
            return
        try:
            spec = Path(self.path).read_text().strip()
        except OSError:
            return
        if spec == "skip" and self.local_rank == 0:
            self.record("fault", step=step, spec=spec)
            while True:
                time.sleep(60)
        if spec.startswith("slow="):
            time.sleep(max(0.0, float(spec[5:]) - 1.0) * self.step_seconds)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")
    code = run(args)
    # the model, the guard and their process groups are out of scope now: destroy the groups and
    # join their threads before the interpreter's teardown (trainer.shutdown says why)
    left = destroy_process_groups()
    if args.progress:
        with open(args.progress, "a") as f:
            f.write(json.dumps({"event": "exited", "rank": int(rank), "pid": os.getpid(), "time": time.time(),
                                "code": code, "worker_threads": left}) + "\n")
    return code


def run(args: argparse.Namespace) -> int:
    t_started = time.time()
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SENTINEL_NODE", socket.gethostname())

    def record(event: str, **fields) -> None:
        if args.progress:
            with open(args.progress, "a") as f:  # O_APPEND: whole lines from many ranks
                f.write(json.dumps({"event": event, "rank": rank, "world": world, "node": node, "pid": os.getpid(),
                                    "time": time.time(), **fields}) + "\n")

    t_admitted = time.time()
    # who hosts this process group's store: the rank-0 agent ("agent", already listening) or the
    # rank-0 worker (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the other workers' connects may be refused and retried)
    worker_store = {"True": "agent", "False": "worker"}.get(os.environ.get("TORCHELASTIC_USE_AGENT_STORE", ""), "")
    record("admitted", started=t_started, process_started=PROCESS_STARTED, worker_store=worker_store)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    model, optim = build_model(args, device)
    t_model = time.time()
    guard = SnapshotGuard(args.snapshot_dir, {"app": ModelOptimState(model, optim)},
                          interval_steps=args.interval_steps, keep=args.keep,
                          migrate_hold_seconds=args.migrate_hold_seconds,
                          memory_interval_steps=args.memory_interval_steps,
                          replica_bytes_per_second=args.replica_bytes_per_second,
                          migrate_ack=args.migrate_ack, progress={"total_steps": args.steps})
    t_guard = time.time()
    start = guard.resume()
    # where the seconds from process start to the first step go (bench/migration.py's timeline)
    phases = {"process_group": t_admitted - t_started, "model": t_model - t_admitted, "guard": t_guard - t_model,
              "load": time.time() - t_guard}
    record("resumed", start=start, phases={k: round(v, 4) for k, v in phases.items()}, source=str(guard.resumed_from or ""),
           channel_error=guard.channel_error, skipped=[str(p) for p in guard.skipped_on_resume],
           restore=guard.restore_summary())
    loss_fn = nn.CrossEntropyLoss()
    record_snapshots = _GuardLog(guard, rank, record)
    fault = _DrillFault(os.environ.get("SENTINEL_DRILL_FAULT_FILE", ""), int(os.environ.get("LOCAL_RANK", 0)),
                        args.step_seconds, record)
    for step in range(start, args.steps):
        fault(step)  # drills only: nothing unless SENTINEL_DRILL_FAULT_FILE names an existing file
        t0 = time.perf_counter()
        loss = train_step(model, optim, loss_fn, args, step, device)
        if rank == 0:
            record("step", step=step, loss=round(loss.item(), 6))
        try:
            guard.step(step)
        except NodeDrained as exc:
            record_snapshots()
            # A peer was drained during the migrate hold: leave at once so torchrun restarts this
            # worker group with the spare; a clean interpreter teardown only delays the takeover.
            record("drained", step=step, reason=str(exc)[:200])
            sys.stderr.write(f"sentinel: {exc}\n")
            sys.stderr.flush()
            os._exit(75)
        record_snapshots()
        pad = args.step_seconds - (time.perf_counter() - t0)
        if pad > 0:
            time.sleep(pad)
    guard.close()
    record_snapshots()
    record("guard", **guard.summary())
    digests = state_digests(model, optim)
    if rank == 0:
        if args.final:
            Path(args.final).write_text(json.dumps({**digests, "steps": args.steps, "world": world,
                                                    "resumed_at": start, "guard": guard.summary()}))
        record("finished", **digests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
