"""The cost of progress from every rank, side by side in one run (medians).

One gloo job (``--ranks`` processes, "nodes" of two ranks) runs a fixed step — a matmul loop of
about ``--step-ms`` of compute, then an all-reduce of the gradients on the training group — in
blocks of ``--block`` steps, alternating two modes, the order rotating each round (round 0 is
warm-up and left out):

* ``off``: the bare step;
* ``on``: the same step plus what ``SnapshotGuard.step`` adds for progress and hangs:
  ``Progress.on_step`` every step (with the flight recorder on: ``TORCH_FR_BUFFER_SIZE``), the
  K-step exchange on a control group of its own, straggler scoring, and the hang watch's thread
  polling the job's store.

A step is timed from barrier to barrier on rank 0 (the slowest rank). Printed: the median step of
each mode, the overhead as a fraction of a step, and the median cost of one exchange.

    python bench/progress_overhead.py [--ranks 4] [--rounds 6] [--block 20] [--every 5] [--json out.json]
    python bench/progress_overhead.py --smoke      # a few steps: that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.shutdown import then_destroy_process_groups  # noqa: E402
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")  # as the drill: a window of this job's collectives

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench._report import add_json_argument, report  # noqa: E402

SMOKE_FIGURES = ("progress_overhead_fraction", "progress_step_off_seconds", "progress_step_on_seconds",
                 "progress_exchange_seconds", "progress_exchange_amortised_fraction")


@then_destroy_process_groups  # its objects gone, the groups' threads are joined (trainer.shutdown)
def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    from sentinel.channel import NullEndpoint
    from sentinel.hang import HangSettings
    from trainer.progress import JobWatch

    control = dist.new_group(backend="gloo")
    watch = JobWatch(endpoint=NullEndpoint(), rank=rank, world=world, control_group=control,
                     # T of an hour: the "off" blocks call no on_step, which must not look like a hang;
                     # the watch thread polls the store all the same
                     every=args.every, hang=HangSettings(timeout_seconds=3600), store=store,
                     prefix="sentinel/hang/bench", node=f"node{rank // 2}")
    a = torch.randn(128, 128)
    grads = torch.randn(64 * 1024)
    # calibrate the matmul count to ~step_ms of compute (rank 0's, broadcast)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    n = torch.tensor([max(1, int(args.step_ms / 1000 / per))])
    dist.broadcast(n, 0)
    n = int(n)
    times: dict[str, list[float]] = {"off": [], "on": []}
    step = 0
    for rnd in range(args.rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        for mode in order:
            for _ in range(args.block):
                dist.barrier()
                t = time.perf_counter()
                for _ in range(n):
                    a @ a
                dist.all_reduce(grads)
                if mode == "on":
                    watch.on_step(step)
                dist.barrier()
                if rnd > 0:
                    times[mode].append(time.perf_counter() - t)
                step += 1
    # the "on" steps include one exchange every `every` steps (on_step counts its own steps)
    exch = list(watch.progress.exchange_seconds)
    watch.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "exchange": exch, "matmuls": n}))
    dist.barrier()



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--every", type=int, default=5, help="the exchange every K steps (the guard: 5)")
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--smoke", action="store_true", help="a few steps with 2 ranks: that it runs")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.rounds, args.block, args.every, args.step_ms = 2, 2, 4, 2, 5.0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(args.ranks, port, args, out), nprocs=args.ranks)
        res = json.loads(Path(out).read_text())
    off, on = statistics.median(res["times"]["off"]), statistics.median(res["times"]["on"])
    exch = statistics.median(res["exchange"]) if res["exchange"] else None
    overhead = (on - off) / off
    per_step_exchange = exch / args.every if exch is not None else None
    print(f"progress overhead: {args.ranks} ranks (gloo, CPU), exchange every {args.every} steps, "
          f"{len(res['times']['off'])} steps per mode after warm-up")
    print(f"{'mode':<40} {'median step (ms)':>18}")
    print(f"{'off (bare step)':<40} {off * 1000:>18.3f}")
    print(f"{'on (progress + exchange + hang watch)':<40} {on * 1000:>18.3f}")
    print(f"overhead: {overhead * 100:+.3f} % of a step (median on vs median off)")
    if exch is not None:
        print(f"one exchange: {exch * 1000:.3f} ms median; amortised over {args.every} steps: "
              f"{per_step_exchange / off * 100:.3f} % of a step")
    figures = {"progress_overhead_fraction": overhead, "progress_step_off_seconds": off,
               "progress_step_on_seconds": on, "progress_exchange_seconds": exch,
               "progress_exchange_amortised_fraction": per_step_exchange / off if per_step_exchange is not None else None}
    if args.json:
        args.json.write_text(json.dumps(report("progress_overhead", figures), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
