"""How a replacement worker gets to its first step: the three warm-start options of issue 16,
measured side by side on this machine (medians of --runs, interleaved).

  cold process       what plain torchrun does: a fresh `python -m trainer.train` interpreter
                     imports torch, then torch imports more lazily on the first model/step
  forkserver fork    what `python -m trainer.elastic` does: fork a forkserver that preloaded
                     torch, trainer.warmup and the training module
  in-process         keep the interpreter (NVIDIA resiliency extension style): destroy the process
                     group and create it again; only the re-init is paid

Each worker here is one rank of a world of 1 (gloo); "to ready" ends after model + FSDP2 +
optimizer are built, i.e. what the worker needs before it loads the snapshot.

    python bench/warm_start.py [--runs 5] [--json PATH] [--smoke]

``--smoke``: one run of each. Each run (cold + forkserver) is written to the JSON as it finishes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

READY = r"""
import os, sys, time
t0 = float(sys.argv[1])
import torch, torch.distributed as dist
from trainer.train import TinyTransformer, fully_shard
t_import = time.time()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
m = TinyTransformer(256, 64, 2, 4)
for layer in m.layers:
    fully_shard(layer)
fully_shard(m)
torch.optim.AdamW(m.parameters(), lr=1e-3)
t_ready = time.time()
dist.destroy_process_group()
print(t_import - t0, t_ready - t0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cold(_run: int) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", READY, repr(time.time()), str(free_port())], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout.split()
    return float(out[0]), float(out[1])


def _forked(t0: float, port: str, q) -> None:
    sys.argv = ["x", repr(t0), port]
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        exec(compile(READY, "ready", "exec"), {"__name__": "__ready__"})
    q.put(buf.getvalue())


def forkserver(ctx, _run: int) -> tuple[float, float]:
    q = ctx.Queue()
    p = ctx.Process(target=_forked, args=(time.time(), str(free_port()), q))
    p.start()
    out = q.get(timeout=300).split()
    p.join(timeout=60)
    return float(out[0]), float(out[1])


def in_process(runs: int) -> list[float]:
    """Re-create the process group in this (warm) interpreter; the model stays."""
    import torch.distributed as dist

    out = []
    for _ in range(runs):
        t0 = time.time()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        group = dist.new_group(backend="gloo")  # what SnapshotGuard creates
        dist.destroy_process_group(group)
        dist.destroy_process_group()
        out.append(time.time() - t0)
    return out


SMOKE_FIGURES = ("cold_process_ready_seconds", "cold_process_import_seconds", "forkserver_ready_seconds",
                 "in_process_reinit_seconds", "cold_over_forkserver_ratio")


def summarise(runs: list[dict]) -> dict[str, float | None]:
    """Medians of the finished runs; the ratio divides two "to ready" medians of this run."""
    med = statistics.median
    cold_ = [r for r in runs if r["option"] == "cold"]
    fork_ = [r for r in runs if r["option"] == "fork"]
    inproc = [r for r in runs if r["option"] == "in_process"]
    f: dict[str, float | None] = {
        "cold_process_ready_seconds": med(r["ready"] for r in cold_) if cold_ else None,
        "cold_process_import_seconds": med(r["imports"] for r in cold_) if cold_ else None,
        "forkserver_ready_seconds": med(r["ready"] for r in fork_) if fork_ else None,
        "in_process_reinit_seconds": med(r["ready"] for r in inproc) if inproc else None}
    if f["cold_process_ready_seconds"] and f["forkserver_ready_seconds"]:
        f["cold_over_forkserver_ratio"] = f["cold_process_ready_seconds"] / f["forkserver_ready_seconds"]
    return {k: None if v is None else round(v, 4) for k, v in f.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.runs = 1
    results = _report.Results(args.json, "warm_start", summarise)
    sys.path.insert(0, str(REPO))
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "trainer.warmup", "trainer.train"])
    ctx = multiprocessing.get_context("forkserver")
    warmed = ctx.Process(target=time.sleep, args=(0,))
    warmed.start()
    warmed.join()
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "fork": []}
    for i in range(args.runs):
        rows["cold"].append(cold(i))
        results.add({"option": "cold", "imports": rows["cold"][-1][0], "ready": rows["cold"][-1][1]})
        rows["fork"].append(forkserver(ctx, i))
        results.add({"option": "fork", "imports": rows["fork"][-1][0], "ready": rows["fork"][-1][1]})
    inproc = in_process(args.runs)
    for v in inproc:
        results.add({"option": "in_process", "ready": v})
    med = statistics.median
    load = os.getloadavg()[0]
    print(f"host: {os.cpu_count()} CPUs, load average {load:.1f}; medians of {args.runs}")
    print(f"{'option':<44} {'imports done s':>15} {'ready s':>9}")
    print(f"{'cold process (plain torchrun)':<44} {med(r[0] for r in rows['cold']):>15.3f} {med(r[1] for r in rows['cold']):>9.3f}")
    print(f"{'forkserver fork (trainer.elastic)':<44} {med(r[0] for r in rows['fork']):>15.3f} {med(r[1] for r in rows['fork']):>9.3f}")
    print(f"{'in-process re-init (process group only)':<44} {'-':>15} {med(inproc):>9.3f}")
    ratio = med(r[1] for r in rows["cold"]) / med(r[1] for r in rows["fork"])
    print(f"cold / forkserver: {ratio:.1f}x")
    results.finish()

if __name__ == "__main__":
    main()
