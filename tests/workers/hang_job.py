"""A small gloo job for the hang tests: Progress + HangWatch as the guard wires them, a training
all-reduce per step, and one faulty rank.

    python tests/workers/hang_job.py RANK WORLD PORT OUTDIR FAULT FAULT_RANK FAULT_STEP

FAULT: ``stop`` (the rank SIGSTOPs itself before the step's collective), ``skip`` (it never
enters the collective: sleeps in "compute"), ``none``. Each rank that reaches a verdict writes
``OUTDIR/verdict-<rank>.json`` and exits with EXIT_HANG, as the guard does."""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sentinel.hang import HangSettings  # noqa: E402
from trainer.progress import EXIT_HANG, HangWatch, Progress, group_key  # noqa: E402


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, fault, fault_rank, fault_step = Path(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    steps = int(os.environ.get("HANG_JOB_STEPS", "40"))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # the test hosts it, as an agent would
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    control = dist.new_group(backend="gloo")
    progress = Progress(every=5, group=control, rank=rank, world=world, node=f"node{rank // 2}",
                        exclude=(group_key(control),))

    def on_verdict(v):
        (out / f"verdict-{rank}.json").write_text(json.dumps({**v.as_dict(), "rank": rank, "time": time.time(),
                                                              "last_done_wall": last_done[0]}))
        os._exit(EXIT_HANG)

    last_done = [time.time()]
    watch = HangWatch(progress, store, "sentinel/hang/test", settings=HangSettings(timeout_seconds=2.0, gather_seconds=1.0),
                      on_verdict=on_verdict, tick=0.1)
    watch.start()
    t = torch.ones(16)
    for step in range(steps):
        time.sleep(0.01)  # compute
        if rank == fault_rank and step == fault_step:
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault == "skip":
                time.sleep(3600)
        dist.all_reduce(t)
        progress.on_step(step)
        last_done[0] = time.time()
        if progress.job is not None and rank == 0 and progress.exchanges == 1:
            (out / "progress.json").write_text(json.dumps({"nodes": progress.job.nodes, "figures": progress.job.figures}))
    watch.stop()
    (out / f"done-{rank}").write_text(json.dumps({"verdict": watch.verdict.as_dict() if watch.verdict else None}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
