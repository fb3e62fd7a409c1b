"""Run a test job's N ranks as forks of one interpreter that imported torch once.

    python tests/workers/forkrun.py --nproc N SCRIPT [ARGS...]
    python tests/workers/forkrun.py --nproc N -m MODULE [ARGS...]

For tests whose subject is what the ranks do (the memory tier, snapshots), not how they were
launched. ``torchrun --standalone`` starts N+1 fresh interpreters that each import torch, about
70 % of a small 4-rank job's CPU on a 2-core host; here SCRIPT is imported once (its work must be
under ``if __name__ == "__main__"``, calling ``main()``), then each rank is a ``fork()`` that gets
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and
calls ``main()``: the same start a rank gets from trainer.elastic's preloaded forkserver.

Like torchrun: when a rank fails, the others are stopped (SIGTERM, then SIGKILL after 30 s) and
the exit status is the first failure's; every rank's output goes to this process's stdout/stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import time

from sentinel_tools.drill import free_port  # below the ephemeral range: no bind(0) elsewhere takes it

STOP_GRACE_S = 30.0


def die_with_parent() -> None:
    """A rank gets SIGKILL when this launcher dies (a test's timeout kills only the launcher)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the call
        os._exit(1)


def run_rank(main, rank: int, world: int, port: int, argv: list[str]) -> int:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "forkrun"})
    sys.argv = argv
    try:
        rc = main()
        return int(rc or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def main() -> int:
    argv = sys.argv[1:]  # parsed by hand: everything after SCRIPT or MODULE is the job's, verbatim
    if len(argv) < 3 or argv[0] != "--nproc" or not argv[1].isdigit() or (argv[2] == "-m" and len(argv) < 4):
        print(__doc__, file=sys.stderr)
        return 2
    nproc = int(argv[1])
    if argv[2] == "-m":  # imports torch and the job's modules: once, before the forks
        module = importlib.import_module(argv[3])
        script, args = module.__file__, argv[4:]
    else:
        script, args = argv[2], argv[3:]
        spec = importlib.util.spec_from_file_location("forkrun_job", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    port = free_port()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                die_with_parent()
                rc = run_rank(module.main, rank, nproc, port, [script, *args])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)  # never back into the parent's code, nor its interpreter teardown
        children[pid] = rank
    first_failure = 0
    stop_at = None
    while children:
        if stop_at is not None and time.monotonic() > stop_at:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            stop_at = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG) if stop_at is not None else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = children.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and first_failure == 0:
            print(f"forkrun: rank {rank} exited with {rc}; stopping the others", file=sys.stderr)
            first_failure = rc if rc > 0 else 128 - rc
            for other in children:
                os.kill(other, signal.SIGTERM)
            stop_at = time.monotonic() + STOP_GRACE_S
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
