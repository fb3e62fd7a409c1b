"""How long the training loop is blocked per snapshot, side by side in one run:

  (a) Sentinel: SnapshotGuard (dcp.async_save, staging to host memory, write in the background)
  (b) blocking dcp.save
  (c) torch.save of the full state dict
  (d) a plain memcpy of the same bytes into a preallocated buffer: the physical floor

for ~256 MB and ~1 GB of state per rank (one rank, gloo, this machine's disk), and the idle cost
of guard.step() per training step (2 ranks: one tiny all-reduce plus a channel poll).

    python bench/snapshot_stall.py [--sizes-mb 256 1024] [--repeats 5] [--json PATH] [--smoke]

Like with like: in each repeat the memcpy floor runs in this process right before Sentinel's stall,
then dcp.save, then torch.save, so all four see the same load; the ratios are medians of the
per-repeat ratios (``stall_<MB>mb_sentinel_over_memcpy_ratio`` = Sentinel's stall / memcpy,
``stall_<MB>mb_dcp_save_over_sentinel_ratio`` = blocking dcp.save / Sentinel's stall).
``--smoke``: 16 MB, 2 repeats, 200 idle steps. Each size is written to the JSON as it finishes.

``--json`` figures (the goodput simulator's inputs are the last two, from the largest size):
``stall_<MB>mb_<path>_seconds`` per row, ``guard_step_idle_seconds``,
``async_stall_seconds_per_gb`` (Sentinel's stall per 10^9 bytes of state per rank) and
``dcp_save_bytes_per_second`` (a blocking save's write rate on this machine's disk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer.shutdown import then_destroy_process_groups  # noqa: E402
import _report  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sentinel.channel import RankEndpoint  # noqa: E402

from sentinel.daemon_endpoint import DaemonEndpoint  # noqa: E402
from trainer.guard import SnapshotGuard  # noqa: E402

CHUNK_MB = 16


def make_state(mb: int) -> dict[str, torch.Tensor]:
    n = max(1, mb // CHUNK_MB)
    return {f"w{i}": torch.randn(CHUNK_MB * 1024 * 1024 // 4) for i in range(n)}


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(mb: int, repeats: int, work: Path) -> dict[str, float]:
    state = make_state(mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    floor = {k: torch.empty_like(v) for k, v in state.items()}
    memcpy, sentinel, blocking, tsave, first = [], [], [], [], None
    guard = SnapshotGuard(work / f"guard{mb}", state, keep=1)
    for i in range(repeats):
        t0 = time.perf_counter()
        for k, v in state.items():
            floor[k].copy_(v)
        memcpy.append(time.perf_counter() - t0)

        guard._pending[f"b{i}"] = type("R", (), {"type": "snapshot", "id": f"b{i}"})()  # as if the daemon asked
        t0 = time.perf_counter()
        guard.step(i)
        blocked = time.perf_counter() - t0
        if i == 0:
            first = blocked  # first staging allocates its host buffers; later ones reuse them
        else:
            sentinel.append(blocked)
        guard._wait_inflight()

        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(work / f"dcp{mb}-{i}"))
        blocking.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        torch.save(state, work / f"full{mb}-{i}.pt")
        tsave.append(time.perf_counter() - t0)
    guard.close()
    paired = range(1, repeats)  # the repeats with a Sentinel stall past the first
    return {"mb": nbytes / 2**20, "bytes": nbytes, "memcpy": med(memcpy), "sentinel": med(sentinel), "sentinel_first": first,
            "dcp_save": med(blocking), "torch_save": med(tsave),
            "sentinel_over_memcpy": med([sentinel[i - 1] / memcpy[i] for i in paired]),
            "dcp_save_over_sentinel": med([blocking[i] / sentinel[i - 1] for i in paired])}


@then_destroy_process_groups  # its objects gone, the groups' threads are joined (trainer.shutdown)
def idle_worker(rank: int, world: int, port: int, steps: int, out: dict, runtime: str) -> None:
    os.environ["SENTINEL_RUNTIME_DIR"] = runtime
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    guard = SnapshotGuard(tempfile.mkdtemp(), {"x": torch.zeros(1)})
    assert isinstance(guard.endpoint, RankEndpoint)
    for s in range(50):
        guard.step(s)
    times = []
    for s in range(50, 50 + steps):
        t0 = time.perf_counter()
        guard.step(s)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out["idle"] = med(times)
        out["p99"] = sorted(times)[int(0.99 * len(times))]
    guard.close()


SMOKE_FIGURES = tuple(f"stall_16mb_{p}_seconds" for p in ("memcpy", "sentinel", "sentinel_first", "dcp_save", "torch_save")) + (
    "stall_16mb_sentinel_over_memcpy_ratio", "stall_16mb_dcp_save_over_sentinel_ratio", "async_stall_seconds_per_gb",
    "dcp_save_bytes_per_second", "guard_step_idle_seconds", "guard_step_idle_p99_seconds")



def summarise(rows: list[dict], idle: dict | None = None) -> dict[str, float]:
    figures: dict[str, float] = {}
    sizes = [r for r in rows if "mb" in r]
    for r in sizes:
        for path in ("memcpy", "sentinel", "sentinel_first", "dcp_save", "torch_save"):
            figures[f"stall_{r['mb']:.0f}mb_{path}_seconds"] = round(r[path], 4)
        for ratio in ("sentinel_over_memcpy", "dcp_save_over_sentinel"):
            figures[f"stall_{r['mb']:.0f}mb_{ratio}_ratio"] = round(r[ratio], 3)
    if sizes:
        big = max(sizes, key=lambda r: r["bytes"])
        figures["async_stall_seconds_per_gb"] = round(big["sentinel"] / (big["bytes"] / 1e9), 4)
        figures["dcp_save_bytes_per_second"] = round(big["bytes"] / big["dcp_save"])
    for r in rows:
        if "idle" in r:
            figures["guard_step_idle_seconds"] = r["idle"]
            figures["guard_step_idle_p99_seconds"] = r["p99"]
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--idle-steps", type=int, default=2000)
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.smoke:
        args.sizes_mb, args.repeats, args.idle_steps = [16], 2, 200
    if args.repeats < 2:
        ap.error("--repeats must be >= 2 (the first Sentinel snapshot allocates its buffers and is reported apart)")
    torch.set_num_threads(1)
    results = _report.Results(args.json, "snapshot_stall", summarise)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        for mb in args.sizes_mb:
            rows.append(measure(mb, args.repeats, Path(d)))
            results.add(rows[-1])
            for p in Path(d).iterdir():  # free the disk between sizes
                if p.is_file():
                    p.unlink()
    print(f"{'state MB':>9} {'memcpy ms':>10} {'Sentinel ms':>12} {'(first)':>8} {'dcp.save ms':>12} {'torch.save ms':>14} "
          f"{'Sentinel/memcpy':>16} {'dcp.save/Sentinel':>18}")
    for r in rows:
        print(f"{r['mb']:>9.0f} {r['memcpy'] * 1e3:>10.1f} {r['sentinel'] * 1e3:>12.1f} {r['sentinel_first'] * 1e3:>8.0f} "
              f"{r['dcp_save'] * 1e3:>12.1f} {r['torch_save'] * 1e3:>14.1f} {r['sentinel_over_memcpy']:>16.2f} "
              f"{r['dcp_save_over_sentinel']:>18.1f}")
    print("medians of", args.repeats, "snapshots (Sentinel: of the repeats after the first); targets: Sentinel <= 2x memcpy, "
          ">= 10x less than blocking dcp.save")
    with tempfile.TemporaryDirectory() as runtime:
        daemon = DaemonEndpoint(Path(runtime))
        out = mp.Manager().dict()
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(idle_worker, args=(2, port, args.idle_steps, out, runtime), nprocs=2, join=True)
        daemon.close()
    print(f"idle guard.step(): median {out['idle'] * 1e6:.0f} us, p99 {out['p99'] * 1e6:.0f} us per step "
          f"(2 ranks, gloo all-reduce + channel poll) = {out['idle'] / 0.05 * 100:.2f} % of a 50 ms step (target <= 1 %)")
    results.add({"idle": out["idle"], "p99": out["p99"]})
    results.finish()

if __name__ == "__main__":
    main()
