"""torchft 0.2.0, configured as its README and train_ddp.py example have a user run it: a
Lighthouse (``torchft_lighthouse --min_replicas 1``), and one replica group per data-parallel
replica, each its own ``torchrun --nproc-per-node 1`` job (train_ddp.py: "for DDP we can use
replica groups of size 1"), a torchft Manager on ProcessGroupGloo, torchft's DDP and
OptimizerWrapper. A group that dies is left out of the next quorum once its heartbeats stop
(the Lighthouse's heartbeat timeout); the others go on with the groups left, each step averaging
the gradients of the groups that took part; a restarted group joins the next quorum and heals:
it fetches the live state (model, optimizer, step) from a healthy group, so nothing is recomputed,
but the steps taken while it was away saw only the survivors' slices of the batch.

Docs followed:
  https://github.com/pytorch/torchft#readme                 (Lighthouse, REPLICA_GROUP_ID, torchrun per group)
  https://github.com/pytorch/torchft/blob/main/train_ddp.py (Manager, DDP, OptimizerWrapper, PGTransport)
  https://docs.pytorch.org/torchft/                          (Manager: use_async_quorum, timeouts)

The batch of step s is the reference batch of s, sliced by replica group (group g of G takes
slice g). ``use_async_quorum=False``: the quorum (and healing) completes before the forward pass,
so a healed group computes the step it healed to on that step's data.

    REPLICA_GROUP_ID=g NUM_REPLICA_GROUPS=G TORCHFT_LIGHTHOUSE=http://127.0.0.1:P \
        torchrun --standalone --nproc-per-node 1 --max-restarts 3 bench/peer_jobs/torchft_job.py --progress F
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402

from bench.peer_jobs import common  # noqa: E402


def main() -> None:
    ap = common.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="Manager timeout (s), train_ddp.py's")
    args = ap.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    log = common.Log(args.progress, f"group{group}")
    log("started", rank=group, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    model, inner = common.build_model(args)

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # train_ddp.py's gloo timeout
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"peers_{group}", timeout=timedelta(seconds=args.timeout),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device="cpu"),
                      use_async_quorum=False)
    start_barrier(group, groups)
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, inner)
    resumed = False
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        optim.zero_grad()  # the quorum; a recovering group heals here
        step = manager.current_step()
        if not resumed:
            log("resumed", rank=group, start=step, source="healed" if step else "")
            resumed = True
        common.maybe_crash(step, group, log)
        x, y = common.batch(args, step, group, groups)
        loss = common.loss_of(ddp, args, x, y)
        loss.backward()
        participants = manager.num_participants()
        if manager.should_commit():
            inner.step()
            log("step", step=step, participants=participants, compute=round(time.perf_counter() - t0, 6),
                loss=round(loss.item(), 6))
        common.pad(t0, args.step_seconds)
    common.finish(log, args if group == 0 else _no_final(args), model, world=groups, rss=common.peak_rss_bytes())
    manager.shutdown(wait=False)
    os._exit(0)  # no interpreter teardown beside the Manager's threads; the work is written


def start_barrier(group: int, groups: int) -> None:
    """At the job's first start only (PEERS_START_BARRIER names a directory): every group's Manager
    heartbeats before the first quorum, else with --min_replicas 1 the first group up trains alone
    until the Lighthouse's next quorum. A group started later (a replacement) heals instead."""
    where = os.environ.get("PEERS_START_BARRIER", "")
    if not where or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
        return
    Path(where, str(group)).touch()
    while len(list(Path(where).iterdir())) < groups:
        time.sleep(0.05)
    time.sleep(1.0)  # a few of the Managers' 100 ms heartbeats: every group is in the first quorum


def _no_final(args):
    args.final = ""
    return args


if __name__ == "__main__":
    sys.exit(main())
