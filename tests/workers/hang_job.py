"""A small gloo job for the hang and straggler tests: JobWatch as SnapshotGuard wires it (progress
exchange on a control group, the hang watch on the job's store, straggler scoring), a training
all-reduce per step, and one faulty rank.

    python tests/workers/hang_job.py RANK WORLD PORT OUTDIR FAULT FAULT_RANK FAULT_STEP

FAULT: ``stop`` (the rank SIGSTOPs itself before the step's collective), ``skip`` (it never
enters the collective: sleeps in "compute"), ``slow`` (the fault rank's node computes 1.5x as
long from FAULT_STEP on), ``none``. Env: HANG_JOB_STEPS, HANG_JOB_PER_NODE
(ranks per node), HANG_JOB_COMPUTE (seconds of "compute" a step, 0.03), HANG_JOB_TIMEOUT (the hang T; empty: the defaults). A rank that reaches a
verdict writes ``OUTDIR/verdict-<rank>.json`` and exits with EXIT_HANG, as the guard does; at
the end each rank writes ``OUTDIR/done-<rank>`` with the reports it sent its daemon."""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sentinel.channel import NullEndpoint  # noqa: E402
from sentinel.hang import HangSettings  # noqa: E402
from trainer.progress import JobWatch  # noqa: E402
from trainer.shutdown import then_destroy_process_groups  # noqa: E402


class Recorder(NullEndpoint):
    """This rank's daemon end, as the test sees it: the reports it would have received."""

    def __init__(self) -> None:
        super().__init__()
        self.reports = []

    def report(self, report) -> bool:
        self.reports.append({**report.detail, "report": report.kind, "step": report.step})
        return True


@then_destroy_process_groups  # its objects gone, the groups' threads are joined (trainer.shutdown)
def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, fault, fault_rank, fault_step = Path(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    steps = int(os.environ.get("HANG_JOB_STEPS", "40"))
    per_node = int(os.environ.get("HANG_JOB_PER_NODE", "2"))
    timeout = os.environ.get("HANG_JOB_TIMEOUT", "2.0")
    COMPUTE = float(os.environ.get("HANG_JOB_COMPUTE", "0.03"))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))  # the test hosts it, as an agent would
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    control = dist.new_group(backend="gloo")
    endpoint = Recorder()

    def leave(code: int) -> None:
        v = watch.watch.verdict
        (out / f"verdict-{rank}.json").write_text(json.dumps({**v.as_dict(), "rank": rank, "reports": endpoint.reports}))
        os._exit(code)

    # gather 4 s, not 1: at load ~10 (the suite on 2 cores) a rank that can talk took over 1 s to
    # publish its report and was named "stopped" (ci18c, ci19b); the verdict, not its speed, is the subject
    hang = HangSettings(timeout_seconds=float(timeout), gather_seconds=4.0) if timeout else HangSettings()
    watch = JobWatch(endpoint=endpoint, rank=rank, world=world, control_group=control,
                     every=5, hang=hang, store=store, prefix="sentinel/hang/test", node=f"node{rank // per_node}",
                     total_steps=steps, exit=leave)
    t = torch.ones(16)
    for step in range(steps):
        slow = fault == "slow" and rank // per_node == fault_rank // per_node and step >= fault_step
        time.sleep(COMPUTE * (1.5 if slow else 1.0))  # compute
        if rank == fault_rank and step == fault_step:
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault == "skip":
                time.sleep(3600)
        dist.all_reduce(t)
        watch.on_step(step)
        if watch.progress.job is not None and rank == 0 and watch.progress.exchanges == 1:
            (out / "progress.json").write_text(json.dumps({"nodes": watch.progress.job.nodes,
                                                           "figures": watch.progress.job.figures}))
    watch.close()
    (out / f"done-{rank}").write_text(json.dumps({"verdict": watch.watch.verdict.as_dict() if watch.watch and watch.watch.verdict else None,
                                                  "reports": endpoint.reports}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
