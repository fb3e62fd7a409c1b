"""Re-rendezvous time against the number of nodes: N local torchrun agents (c10d rendezvous on a
standalone store, one CPU worker each, gloo), one worker killed, time until every agent has
re-rendezvoused and restarted its worker (``rendezvous``: the last new worker's first line) and
until the new group has finished one all-reduce (``restart``: the job can step again).

Then fits the growth (linear and logarithmic in N) and prints what each fit says at 2,048 nodes;
``sentinel simulate goodput --measured`` does the same fit from the ``--json`` figures.

    python bench/rendezvous_scale.py [--agents 2 4 8 16] [--repeats 3] [--json PATH] [--smoke]

``--smoke``: 2 agents, one kill. Each job size is written to the JSON as it finishes.

On a machine with fewer cores than agents, every agent and worker shares the CPUs (each new
worker imports torch), so the growth measured here is mostly CPU contention: an upper bound on
what the rendezvous itself costs (docs/goodput.md).
"""

from __future__ import annotations

import time

T_START = time.time()  # a restarted worker's first line, before it imports torch

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402


# -- the worker (one per agent, started by torchrun) ------------------------------------------------
def worker(out: Path) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    x = torch.ones(1)
    dist.all_reduce(x)
    ready = time.time()
    # keyed by pid: TORCHELASTIC_RESTART_COUNT differs between agents (only some count a failure)
    tmp = out / f".w{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "start": T_START, "ready": ready, "pid": os.getpid(), "world": int(x.item())}))
    os.replace(tmp, out / f"w{os.getpid()}.json")
    while not (out / "stop").exists():  # train until told to stop (or until a peer dies: gloo raises)
        dist.all_reduce(x)
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


# -- the driver -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def round_files(out: Path, since: float, n: int) -> list[dict] | None:
    """The workers of the round started after ``since``, once all ``n`` ranks are ready."""
    rows = {}
    for p in out.glob("w*.json"):
        row = json.loads(p.read_text())
        if row["start"] > since:
            rows[row["rank"]] = row
    return [rows[r] for r in range(n)] if len(rows) == n and set(rows) == set(range(n)) else None


def wait_round(out: Path, since: float, n: int, deadline: float) -> list[dict] | None:
    while time.monotonic() < deadline:
        rows = round_files(out, since, n)
        if rows is not None:
            return rows
        time.sleep(0.05)
    return None


def measure(n: int, repeats: int, timeout: float, work: Path) -> dict:
    """One job of ``n`` agents; ``repeats`` worker kills, each followed by a full re-rendezvous."""
    out = work / f"n{n}"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = open(out / "log.txt", "w")
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "trainer.store", "--port", str(port)], cwd=REPO, env=env,
                                      stdout=logs, stderr=subprocess.STDOUT, start_new_session=True))
        end = time.monotonic() + 30
        while not port_open(port):
            if time.monotonic() > end:
                return {"n": n, "error": "rendezvous store did not start"}
            time.sleep(0.05)
        conf = f"is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout={int(timeout)}"
        for _ in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", f"--nnodes={n}:{n}", "--nproc-per-node=1",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=rdzv-bench-{os.getpid()}-{n}",
                 f"--rdzv-conf={conf}", f"--max-restarts={repeats}", "--monitor-interval=0.1",
                 str(Path(__file__).resolve()), "--worker", str(out)],
                cwd=REPO, env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True))
        first = wait_round(out, 0.0, n, time.monotonic() + timeout)
        if first is None:
            return {"n": n, "error": f"the first rendezvous of {n} agents did not finish within {timeout:g} s"}
        rdzv, restart = [], []
        current = first
        for _ in range(repeats):
            time.sleep(1.0)  # steady state: every worker stepping
            t_kill = time.time()
            os.kill(current[n - 1]["pid"], signal.SIGKILL)
            rows = current = wait_round(out, t_kill, n, time.monotonic() + timeout)
            if rows is None:
                break
            rdzv.append(max(row["start"] for row in rows) - t_kill)
            restart.append(max(row["ready"] for row in rows) - t_kill)
        if not rdzv:
            return {"n": n, "error": f"no re-rendezvous of {n} agents finished within {timeout:g} s"}
        return {"n": n, "rounds": len(rdzv), "rendezvous": statistics.median(rdzv), "restart": statistics.median(restart),
                "restart_max": max(restart)}
    finally:
        (out / "stop").touch()
        for p in procs[1:]:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        logs.close()


def fit(ns: list[float], ys: list[float], transform) -> tuple[float, float, float]:
    """Least squares y = a + b * transform(n); returns (a, b, rms residual)."""
    xs = [transform(n) for n in ns]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    rms = math.sqrt(statistics.fmean((a + b * x - y) ** 2 for x, y in zip(xs, ys)))
    return a, b, rms


SMOKE_FIGURES = ("rendezvous_n2_seconds", "restart_n2_seconds")


def summarise(rows: list[dict]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for r in rows:
        if "error" not in r:
            figures[f"rendezvous_n{r['n']}_seconds"] = round(r["rendezvous"], 3)
            figures[f"restart_n{r['n']}_seconds"] = round(r["restart"], 3)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=3, help="worker kills (re-rendezvous) per job size")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one rendezvous may take before it counts as failed")
    ap.add_argument("--worker", metavar="DIR", type=Path, help=argparse.SUPPRESS)
    _report.add_json_argument(ap)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if args.smoke:
        args.agents, args.repeats = [2], 1
    results = _report.Results(args.json, "rendezvous_scale", summarise)
    if any(n < 2 for n in args.agents) or args.repeats < 1:
        ap.error("--agents must each be >= 2 and --repeats >= 1")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sentinel-rdzv-") as d:
        for n in args.agents:
            rows.append(measure(n, args.repeats, args.timeout, Path(d)))
            r = rows[-1]
            results.add(r)
            print(f"  {n} agents: " + (r["error"] if "error" in r else
                                        f"rendezvous {r['rendezvous']:.2f} s, restart {r['restart']:.2f} s"), flush=True)
    print(f"\n{os.cpu_count()} CPUs; c10d rendezvous, standalone store, one gloo CPU worker per agent; "
          f"medians of {args.repeats} worker kills")
    print(f"{'agents':>6} {'rounds':>6} {'kill -> all restarted s':>24} {'kill -> first all-reduce s':>27} {'max s':>7}")
    ok = [r for r in rows if "error" not in r]
    for r in rows:
        if "error" in r:
            print(f"{r['n']:>6} {'-':>6} {r['error']}")
        else:
            print(f"{r['n']:>6} {r['rounds']:>6} {r['rendezvous']:>24.2f} {r['restart']:>27.2f} {r['restart_max']:>7.2f}")
    if len(ok) >= 2:
        ns, ys = [r["n"] for r in ok], [r["restart"] for r in ok]
        print("\nfits of kill -> first all-reduce, extrapolated to 2,048 nodes:")
        for name, tf in (("linear", float), ("log2", math.log2)):
            a, b, rms = fit(ns, ys, tf)
            print(f"  {name:<7} {a:7.2f} + {b:6.3f} * {'N' if name == 'linear' else 'log2 N':<7} rms {rms:5.2f} s  "
                  f"-> {a + b * tf(2048):8.1f} s at 2,048")
        for ratio in zip(ok, ok[1:]):
            lo, hi = ratio
            print(f"  {lo['n']} -> {hi['n']} agents: restart x{hi['restart'] / lo['restart']:.2f}")
    results.finish()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
