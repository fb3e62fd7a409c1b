"""What every worker does to the store after a membership change, at 1,024-8,192 workers: the
process-group bootstrap of ``init_process_group`` through a c10d TCPStore, measured with N store
clients (threads of this process, one connection each) against a real store server (a process
of its own, libuv or the classic server).

Phases, each timed from the release of all N clients to the last one done:

* ``connect``: N ``TCPStore(is_master=False)`` connections (what every worker's env:// init does);
* ``barrier``: torch's own ``_store_based_barrier`` (``TORCH_DIST_INIT_BARRIER=1``; off by default
  in torch 2.13), through a ``PrefixStore`` as init_process_group uses it;
* ``broadcast``: the rank-0 key broadcast (ProcessGroupNCCL's unique-id exchange: rank 0 sets a
  128-byte key, every other rank gets it).

The NCCL communicator set-up that follows (rings/trees over the network) needs GPUs and is not
measured here: it is a typed input of the goodput simulator (docs/goodput.md).

    nice -n 10 python bench/pg_bootstrap.py [--workers 1024 2048 4096 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402
from replacement_scale import _server_preexec, free_port, proc_cpu_seconds, raise_fd_limit  # noqa: E402

SERVER = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False, timeout=timedelta(hours=1),
             use_libuv=sys.argv[2] == "1")
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.pause()
"""


def phase(n: int, fn, limit: float) -> tuple[float, int]:
    """Run fn(i) in n threads released at once; (wall seconds, errors)."""
    go = threading.Event()
    errors = [0]
    lock = threading.Lock()

    def body(i: int) -> None:
        go.wait()
        try:
            fn(i)
        except RuntimeError:
            with lock:
                errors[0] += 1

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join(max(0.0, t0 + limit - time.monotonic()))
    alive = sum(t.is_alive() for t in threads)
    return time.monotonic() - t0, errors[0] + alive


def measure(n: int, libuv: bool, limit: float) -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _store_based_barrier

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), "1" if libuv else "0"], stdout=subprocess.PIPE,
                              text=True, preexec_fn=_server_preexec)
    try:
        server.stdout.readline()
        clients: list = [None] * n
        row: dict = {"workers": n, "libuv": libuv}

        def connect(i: int) -> None:
            clients[i] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit))

        for name, fn in (
            ("connect", connect),
            ("barrier", lambda i: _store_based_barrier(i, dist.PrefixStore("default_pg/0//", clients[i]), "0", n,
                                                      timedelta(seconds=limit))),
            ("broadcast", lambda i: clients[i].set("nccl_id", os.urandom(128)) if i == 0 else clients[i].get("nccl_id")),
        ):
            if name != "connect" and any(c is None for c in clients):
                row[f"{name}_error"] = "not every client connected"
                break
            cpu0, s0 = time.process_time(), proc_cpu_seconds(server.pid)
            wall, errors = phase(n, fn, limit)
            row[f"{name}_seconds"] = round(wall, 4)
            row[f"{name}_errors"] = errors
            row[f"{name}_client_cpu_seconds"] = round(time.process_time() - cpu0, 3)
            row[f"{name}_server_cpu_seconds"] = round(proc_cpu_seconds(server.pid) - s0, 3)
        row["load_average"] = round(os.getloadavg()[0], 2)
        return row
    finally:
        server.terminate()
        server.wait(30)


SMOKE_FIGURES = tuple(f"pg_{p}_{k}_n16_seconds" for p in ("connect", "barrier", "broadcast") for k in ("libuv", "classic"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one phase may take")
    _report.add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # 16 workers, once: that it runs (tests/test_bench_smoke.py)
        args.workers, args.repeats = [16], 1
    if min(args.workers) < 2 or args.repeats < 1:
        ap.error("--workers must each be >= 2 and --repeats >= 1")
    limit = raise_fd_limit()
    if limit < 2 * max(args.workers) + 64:
        ap.error(f"open-file limit {limit} too low for {max(args.workers)} clients")
    threading.stack_size(256 << 10)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    rows = []
    for n in args.workers:
        for libuv in (True, False):
            for rep in range(args.repeats):
                r = measure(n, libuv, args.timeout)
                r["repeat"] = rep
                rows.append(r)
                print(f"  N={n:<5} {'libuv' if libuv else 'classic':<7} " + "  ".join(
                    f"{p} {r.get(p + '_seconds', float('nan')):.3f} s ({r.get(p + '_errors', '-')} err, "
                    f"server cpu {r.get(p + '_server_cpu_seconds', float('nan')):.2f} s)"
                    for p in ("connect", "barrier", "broadcast")) + f"  load {r['load_average']}", flush=True)
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; medians of {args.repeats}")
    print(f"{'workers':>7} {'server':<7} {'connect s':>9} {'barrier s':>9} {'broadcast s':>11} {'server cpu s':>12}")
    figures: dict[str, float] = {}
    for n in args.workers:
        for libuv in (True, False):
            rs = [r for r in rows if r["workers"] == n and r["libuv"] == libuv]
            med = {p: statistics.median(r.get(f"{p}_seconds", float("nan")) for r in rs) for p in ("connect", "barrier", "broadcast")}
            cpu = statistics.median(sum(r.get(f"{p}_server_cpu_seconds", 0) for p in ("connect", "barrier", "broadcast")) for r in rs)
            kind = "libuv" if libuv else "classic"
            print(f"{n:>7} {kind:<7} {med['connect']:>9.3f} {med['barrier']:>9.3f} {med['broadcast']:>11.3f} {cpu:>12.2f}")
            for p, v in med.items():
                figures[f"pg_{p}_{kind}_n{n}_seconds"] = round(v, 4)
    _report.write(args.json, "pg_bootstrap", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
