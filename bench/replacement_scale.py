"""What a node replacement costs the rendezvous, from 8 to 2,048 nodes: Sentinel's rank-preserving
slot rendezvous (``trainer/slot_rendezvous.py``) and torch's ``DynamicRendezvousHandler`` (the c10d
backend), side by side in one run.

N lightweight participants — one rendezvous handler each, each on its own TCPStore client
connection, all threads of this one process (no workers, no torch import per participant) — run
the real handler code against a real c10d TCPStore served by a process of its own
(``python -m trainer.store``). Scenarios per N, each timed as one round:

* ``first_join``: N nodes join an empty rendezvous;
* ``replace_one``: one node leaves (as ``trainer.elastic`` does when drained) and a waiting spare
  is admitted while the N-1 survivors re-rendezvous (their workers failed);
* ``replace_two``: two nodes leave at once, two spares.

``--store etcd`` (report ``replacement_scale_etcd``: ``--store tcp etcd --handlers sentinel`` puts the
two stores side by side in one run) adds a third column: the same slot handler with its membership in a 3-member
etcd (Debian's etcd-server on loopback, TLS with the job's CA and client certificates, as
``--rdzv-backend sentinel-etcd`` runs it). Its "ops" are the HTTP requests each participant sent
to etcd (what the server serves; a ``wait`` is a range plus a watch, an ``add`` two requests),
and its store CPU is the three members' together. ``--smoke`` runs both stores.

Per round: wall time (release of all participants -> the last one returned), store operations
per survivor (median, max) and in total, bytes on the wire (keys + values), CPU seconds of the
participants (this process) and of the store server (its /proc stat), so that waits (torch's 1 s
poll), compare-and-set conflicts and CPU contention are told apart. A handler whose round does not
finish within ``--torch-timeout`` stops being measured at that N and above (said so).

    nice -n 10 python bench/replacement_scale.py [--nodes 8 16 ... 1024] [--repeats 3] [--out runs.json] [--json report.json]
    python bench/replacement_scale.py --smoke --out /tmp/r.json      # N = 3 and 4, seconds

``--out`` is appended after every finished round (atomically), with the load average, the git
commit and the exact command: an interrupted run keeps what it measured. ``--json`` writes the
``bench/_report.py`` figures the goodput simulator reads (``replacement_protocol_n<N>_seconds``).
On this 2-core VM every participant shares two CPUs with the store server: the wall time of a
large round is mostly CPU contention (the CPU columns say how much), which a cluster, where each
node has its own CPU, does not have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

SCENARIOS = ("first_join", "replace_one", "replace_two")
HANDLERS = ("sentinel", "torch", "etcd")  # etcd: the sentinel handler on a 3-member etcd (--store etcd)
STORES = {"tcp": ("sentinel", "torch"), "etcd": ("etcd",)}
# the report's name: the TCPStore run's (the simulator's restart curve), and the etcd run's, kept apart
# so that folding one into docs/measured.json does not replace the other
REPORTS = ("replacement_scale", "replacement_scale_etcd")
DEFAULT_NODES = [8, 16, 32, 64, 128, 256, 512, 1024]
SMOKE_NODES = [3, 4]  # the smallest job with two victims and a survivor, and one more: a growth exponent
SMOKE_FIGURES = ("replacement_protocol_n3_seconds", "replacement_protocol_n4_seconds")
# every figure a round promises (tests/test_replacement_scale.py checks --smoke produced them all)
ROUND_FIELDS = ("wall_seconds", "survivor_ops_median", "survivor_ops_max", "ops_total", "ops_per_participant",
                "bytes_total", "participant_cpu_seconds", "store_cpu_seconds", "load_average")


# -- plumbing ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_preexec() -> None:
    """In the store server: room for every participant's connection, and die with the bench (a
    killed bench must not leave a server behind)."""
    import ctypes
    import signal

    raise_fd_limit()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class StoreServer:
    """The rendezvous store in a process of its own (its CPU is measured apart)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.store", "--port", str(self.port)], cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                                     preexec_fn=_server_preexec)
        import torch.distributed as dist

        end = time.monotonic() + 60
        while True:
            try:
                dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=2)).check(["x"])
                break
            except RuntimeError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise SystemExit("the rendezvous store did not start") from None
                time.sleep(0.1)

    def cpu(self) -> float:
        return proc_cpu_seconds(self.proc.pid)

    def client(self) -> Any:
        import torch.distributed as dist

        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=900))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class EtcdServer:
    """Three etcd members on loopback with the job's TLS (their CPU summed)."""

    def __init__(self, work: Path) -> None:
        from sentinel.etcd_pki import make_job_pki
        from sentinel_tools.etcd_cluster import EtcdCluster

        names = ["m0", "m1", "m2"]
        self.cluster = EtcdCluster(work, names, pki=make_job_pki(work / "pki", "bench", {n: [] for n in names}))
        self.cluster.start()

    def cpu(self) -> float:
        return sum(proc_cpu_seconds(m.proc.pid) for m in self.cluster.members.values() if m.proc is not None)

    def client(self) -> Any:
        return self.cluster.store(failover_seconds=60.0, request_seconds=30.0)

    def stop(self) -> None:
        self.cluster.stop()


# -- participants -----------------------------------------------------------------------------------
class Participant:
    """One node's rendezvous handler and the counter of its store operations."""

    def __init__(self, kind: str, server: "StoreServer | EtcdServer", run_id: str, nodes: int, timeout: float) -> None:
        from trainer.slot_rendezvous import CountingStore, SlotRendezvousHandler

        self.kind = kind
        client = server.client()
        self.requests = getattr(client, "requests", None)
        if kind in ("sentinel", "etcd"):
            # heartbeats every 60 s: none inside a round (they are counted apart anyway)
            self.handler = SlotRendezvousHandler(client, run_id, nodes, local_addr="127.0.0.1", join_timeout=timeout,
                                                 keep_alive_interval=60.0, admission_timeout=max(5.0, timeout / 4))
            self.stats = self.handler.stats
            self.client = client
        else:
            from torch.distributed.elastic.rendezvous import RendezvousParameters
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            counted = CountingStore(client)
            backend = C10dRendezvousBackend(counted, run_id)
            # torch's defaults except the join timeout (keep-alive every 5 s, 3 attempts)
            params = RendezvousParameters("c10d", f"127.0.0.1:{server.port}", run_id, nodes, nodes,
                                          local_addr="127.0.0.1", join_timeout=int(timeout), last_call_timeout=1)
            self.handler = create_handler(client, backend, params)
            self.stats = counted.stats
        self.rank: int | None = None

    def ops(self) -> tuple[int, int, int]:
        total, out, got = self.stats.snapshot()
        if self.kind == "etcd":  # the requests etcd served, not the protocol's calls
            total = self.client.requests
        return total, out, got

    def next_rendezvous(self) -> None:
        self.rank = self.handler.next_rendezvous().rank

    def leave(self) -> None:
        if self.kind in ("sentinel", "etcd"):
            self.handler.leave()
            return
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        h = self.handler
        h._stop_heartbeats()

        def leave_op(ctx, deadline):  # what trainer.elastic's graceful leave does for the c10d backend
            if ctx.node in ctx.state.participants:
                return dr._Action.REMOVE_FROM_PARTICIPANTS
            return dr._Action.FINISH

        with h._heartbeat_lock:
            h._op_executor.run(leave_op, time.monotonic() + 60)

    def close(self) -> None:
        stop = getattr(self.handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()


def run_round(parts: list[Participant], call: Callable[[Participant], None], limit: float) -> tuple[float, list]:
    """Release every participant at once; wall time to the last return, and any errors."""
    go = threading.Event()
    ends: list[float | None] = [None] * len(parts)
    errors: list[BaseException | None] = [None] * len(parts)

    def body(i: int) -> None:
        go.wait()
        try:
            call(parts[i])
        except BaseException as exc:  # noqa: BLE001 - reported with the round
            errors[i] = exc
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(parts))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join(max(0.0, t0 + limit + 30 - time.monotonic()))
    if any(t.is_alive() for t in threads):
        return math.inf, ["did not return"]
    return max(ends) - t0, [e for e in errors if e is not None]


class Recorder:
    """Appends each finished round to ``--out`` (atomically rewritten), with the run's context."""

    def __init__(self, path: Path | None, argv: list[str]) -> None:
        self.path = path
        self.doc = {"bench": "replacement_scale", "command": shlex.join([sys.executable, *argv]),
                    "git_commit": git_commit(), "cpus": os.cpu_count(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": []}
        self.runs: list[dict] = []
        if path is not None and path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                old = None
            if not isinstance(old, dict) or not isinstance(old.get("runs"), list):
                raise SystemExit(f"--out {path}: exists and is not this bench's JSON; choose another path")
            self.runs = old["runs"]
        self.runs.append(self.doc)

    def add(self, row: dict) -> None:
        self.doc["rounds"].append(row)
        if self.path is not None:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"runs": self.runs}, indent=1) + "\n")
            os.replace(tmp, self.path)


def measure_handler(kind: str, n: int, repeats: int, timeout: float, server: "StoreServer | EtcdServer", rec: Recorder,
                    scenarios: tuple[str, ...]) -> str | None:
    """All scenarios of one handler at one N. Returns an error if a round did not finish."""
    run_id = f"{kind}-{n}-{os.getpid()}-{time.monotonic_ns()}"
    members = [Participant(kind, server, run_id, n, timeout) for _ in range(n)]
    everyone = list(members)
    try:
        plan = [("first_join", 1)] + [(s, repeats) for s in scenarios if s != "first_join"]
        for scenario, times in plan:
            if scenario not in scenarios and scenario != "first_join":
                continue
            for rep in range(times):
                victims: list[Participant] = []
                if scenario == "first_join":
                    round_parts = members
                else:
                    k = 1 if scenario == "replace_one" else 2
                    # victims spread over the job, a different one each repeat (slot/rank order)
                    by_rank = sorted(members, key=lambda p: p.rank)
                    victims = [by_rank[(n // (k + 1) * (j + 1) + rep) % n] for j in range(k)]
                    spares = [Participant(kind, server, run_id, n, timeout) for _ in range(k)]
                    everyone.extend(spares)
                    survivors = [p for p in members if p not in victims]
                    round_parts = survivors + spares
                before = {id(p): p.ops() for p in everyone}
                ranks_before = {id(p): p.rank for p in members}
                cpu0, store0 = time.process_time(), server.cpu()
                t_leave = time.monotonic()
                for v in victims:
                    v.leave()
                leave_s = time.monotonic() - t_leave
                wall, errors = run_round(round_parts, Participant.next_rendezvous, timeout)
                cpu1, store1 = time.process_time(), server.cpu()
                after = {id(p): p.ops() for p in everyone}
                delta = {k_: tuple(a - b for a, b in zip(after[k_], before.get(k_, (0, 0, 0)))) for k_ in after}
                row: dict[str, Any] = {"handler": kind, "nodes": n, "scenario": scenario, "repeat": rep,
                                       "load_average": round(os.getloadavg()[0], 2)}
                if errors or not math.isfinite(wall):
                    row["error"] = f"did not finish within {timeout:g} s: {errors[0]!r}"[:300]
                    rec.add(row)
                    return row["error"]
                if victims:
                    members = survivors + spares
                    surv = [delta[id(p)][0] for p in survivors]
                    ranks_kept = all(p.rank == ranks_before[id(p)] for p in survivors)
                    row["spare_ranks"] = sorted(p.rank for p in spares)
                    row["victim_ranks"] = sorted(v.rank for v in victims)
                else:
                    surv = [delta[id(p)][0] for p in members]
                    ranks_kept = True
                ranks = sorted(p.rank for p in members)
                row.update({
                    "wall_seconds": round(wall + leave_s, 4), "leave_seconds": round(leave_s, 4),
                    "survivor_ops_median": statistics.median(surv), "survivor_ops_max": max(surv),
                    "ops_total": sum(d[0] for d in delta.values()),
                    "ops_per_participant": round(sum(d[0] for d in delta.values()) / len(round_parts), 2),
                    "bytes_total": sum(d[1] + d[2] for d in delta.values()),
                    "participant_cpu_seconds": round(cpu1 - cpu0, 3), "store_cpu_seconds": round(store1 - store0, 3),
                    "ranks_complete": ranks == list(range(n)), "ranks_kept": ranks_kept,
                })
                if victims:
                    row["spare_took_victim_ranks"] = row["spare_ranks"] == row["victim_ranks"]
                rec.add(row)
                print(f"  {kind:<8} N={n:<5} {scenario:<11} wall {row['wall_seconds']:8.3f} s  survivor ops "
                      f"{row['survivor_ops_median']:>6} (max {row['survivor_ops_max']})  total {row['ops_total']:>8}  "
                      f"bytes {row['bytes_total']:>11}  cpu {row['participant_cpu_seconds']:.2f}+{row['store_cpu_seconds']:.2f} s"
                      f"  load {row['load_average']}", flush=True)
        return None
    finally:
        for p in everyone:
            p.close()


# -- summary ----------------------------------------------------------------------------------------
def exponent(points: dict[int, float]) -> float | None:
    """Least-squares b of y = a * N^b (log-log) over the measured N; None with < 2 points."""
    pts = [(math.log(n), math.log(y)) for n, y in points.items() if y > 0]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def summarise(rows: list[dict], failed: dict[str, tuple[int, str]], nodes: list[int], protocol: bool = True) -> dict[str, float]:
    """The tables, and the figures of the report; ``protocol``: also the simulator's
    ``replacement_protocol_n<N>_seconds`` (only the full TCPStore run's report carries them)."""
    figures: dict[str, float] = {}
    med: dict[tuple[str, str, int], dict] = {}
    for kind in HANDLERS:
        for scen in SCENARIOS:
            for n in nodes:
                rs = [r for r in rows if r["handler"] == kind and r["scenario"] == scen and r["nodes"] == n and "error" not in r]
                if rs:
                    med[kind, scen, n] = {f: statistics.median(r[f] for r in rs) for f in ROUND_FIELDS}
    print(f"\n{os.cpu_count()} CPUs, load average now {os.getloadavg()[0]:.2f}; medians per round; "
          f"ops = store operations (wait/get/set/add/compare_set/check)")
    kinds = [k for k in HANDLERS if any(r["handler"] == k for r in rows)]
    width = {"sentinel": 15, "torch": 12, "etcd": 11}
    head = f"{'scenario':<11} {'N':>5} | " + " | ".join(
        f"{k + ' wall s':>{width[k]}} {'surv ops':>8} {'total ops':>9} {'cpu s':>7}" for k in kinds)
    print(head)
    print("-" * len(head))
    for scen in SCENARIOS:
        for n in nodes:
            cells = []
            for kind in kinds:
                m, w = med.get((kind, scen, n)), width[kind]
                if m:
                    cells.append(f"{m['wall_seconds']:>{w}.3f} {m['survivor_ops_median']:>8g} "
                                 f"{m['ops_total']:>9g} {m['participant_cpu_seconds'] + m['store_cpu_seconds']:>7.2f}")
                elif kind in failed and n >= failed[kind][0]:
                    cells.append(f"{'not finished' if n == failed[kind][0] else 'not run':>{w}} {'-':>8} {'-':>9} {'-':>7}")
                else:
                    cells.append(f"{'-':>{w}} {'-':>8} {'-':>9} {'-':>7}")
            print(f"{scen:<11} {n:>5} | " + " | ".join(cells))
    for kind, (n, err) in failed.items():
        print(f"{kind}: stopped at N={n}: {err}")
    print("\ngrowth exponents b of y = a * N^b (log-log least squares over the N measured):")
    for kind in HANDLERS:
        for scen in SCENARIOS:
            pts = {n: m for (k, s, n), m in med.items() if k == kind and s == scen}
            if len(pts) < 2:
                continue
            bw = exponent({n: m["wall_seconds"] for n, m in pts.items()})
            bo = exponent({n: m["survivor_ops_median"] for n, m in pts.items()})
            bt = exponent({n: m["ops_total"] for n, m in pts.items()})
            print(f"  {kind:<8} {scen:<11} wall N^{bw:.2f}   ops per survivor N^{bo:.2f}   total ops N^{bt:.2f}   "
                  f"(N = {min(pts)}..{max(pts)})")
            tag = f"{kind}_{scen}"
            figures[f"{tag}_wall_exponent_ratio"] = round(bw, 3)
            figures[f"{tag}_total_ops_exponent_ratio"] = round(bt, 3)
    for (kind, scen, n), m in sorted(med.items()):
        tag = f"{kind}_{scen}_n{n}"
        figures[f"{tag}_seconds"] = round(m["wall_seconds"], 4)
        figures[f"{tag}_survivor_ops_count"] = m["survivor_ops_median"]
        figures[f"{tag}_total_ops_count"] = m["ops_total"]
        figures[f"{tag}_cpu_seconds"] = round(m["participant_cpu_seconds"] + m["store_cpu_seconds"], 3)
        figures[f"{tag}_store_cpu_seconds"] = round(m["store_cpu_seconds"], 3)  # the store server's alone (etcd: 3 members)
        figures[f"{tag}_survivor_ops_max_count"] = m["survivor_ops_max"]
        if kind == "sentinel" and scen == "replace_one" and protocol:
            figures[f"replacement_protocol_n{n}_seconds"] = round(m["wall_seconds"], 4)
    lo, hi = min(nodes), max(nodes)
    a, b = med.get(("sentinel", "replace_one", lo)), med.get(("sentinel", "replace_one", hi))
    if a and b:
        print(f"\nsentinel replace_one: N={hi} costs each survivor {b['survivor_ops_median']:g} store ops "
              f"(max {b['survivor_ops_max']:g}); wall {b['wall_seconds']:.3f} s = {b['wall_seconds'] / a['wall_seconds']:.2f}x N={lo}")
    e, e_lo = med.get(("etcd", "replace_one", hi)), med.get(("etcd", "replace_one", lo))
    if e and e_lo:
        print(f"etcd     replace_one: N={hi} costs each survivor {e['survivor_ops_median']:g} etcd requests (max "
              f"{e['survivor_ops_max']:g}); wall {e['wall_seconds']:.3f} s = {e['wall_seconds'] / e_lo['wall_seconds']:.2f}x "
              f"N={lo}; etcd members' CPU {e['store_cpu_seconds']:.2f} s per round")
    t = med.get(("torch", "replace_one", hi))
    if b and t:
        print(f"torch    replace_one at N={hi}: {t['wall_seconds']:.3f} s, {t['survivor_ops_median']:g} ops per survivor "
              f"({t['wall_seconds'] / b['wall_seconds']:.0f}x sentinel's wall)")
    return figures


def report_figures(name: str, figures: dict[str, float]) -> dict[str, float]:
    """The etcd report's names differ from the TCPStore report's (docs/benchmarks.md finds a figure
    by its name): its TCPStore column is ``tcpstore_*``; its load average is the report's own
    (``host.loadavg``, the Conditions line of docs/benchmarks.md)."""
    if name == REPORTS[0]:
        return figures
    return {"tcpstore_" + k[len("sentinel_"):] if k.startswith("sentinel_") else k: v
            for k, v in figures.items() if k != "load_average_ratio"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", help=f"job sizes (default {DEFAULT_NODES})")
    ap.add_argument("--handlers", nargs="+", choices=HANDLERS[:2], default=list(HANDLERS[:2]),
                    help="on the TCPStore: sentinel's slot handler, torch's dynamic handler")
    ap.add_argument("--store", nargs="+", choices=sorted(STORES), default=None,
                    help="tcp: the handlers on one TCPStore (default); etcd: the slot handler on a 3-member etcd "
                         "with TLS, a column of its own (--smoke: both)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--repeats", type=int, default=3, help="replacement rounds per scenario and N (default 3)")
    ap.add_argument("--torch-timeout", type=float, default=600.0,
                    help="seconds a round may take before the handler counts as not finishing (default 600)")
    ap.add_argument("--out", type=Path, help="append every finished round to this JSON file")
    ap.add_argument("--smoke", action="store_true", help=f"N = {SMOKE_NODES}, 1 repeat, 60 s limit: seconds")
    ap.add_argument("--from", dest="from_", type=Path, metavar="RUNS_JSON",
                    help="measure nothing: print the tables (and --json) from the last run in an --out file")
    ap.add_argument("--report", choices=REPORTS, default=None,
                    help=f"the report's name in --json: {REPORTS[1]} (no simulator inputs, folded beside the "
                         f"TCPStore report) when etcd is measured outside --smoke, else {REPORTS[0]}")
    _report.add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.from_ is not None:
        try:
            run = json.loads(args.from_.read_text())["runs"][-1]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            ap.error(f"--from {args.from_}: not an --out file of this bench")
        rounds = run["rounds"]
        failed = {r["handler"]: (r["nodes"], r["error"]) for r in rounds if "error" in r}
        print(f"from {args.from_}: {run['command']} (commit {run['git_commit'][:12]}, started {run['started']})")
        name = args.report or REPORTS[any(r["handler"] == "etcd" for r in rounds)]
        figures = summarise(rounds, failed, sorted({r["nodes"] for r in rounds}), protocol=name == REPORTS[0])
        for kind, (n, _) in failed.items():
            figures[f"{kind}_not_finished_nodes_count"] = n
        figures["load_average_ratio"] = statistics.median(r["load_average"] for r in rounds)
        _report.write(args.json, name, report_figures(name, figures))
        return 0
    stores = args.store or (sorted(STORES) if args.smoke else ["tcp"])
    handlers = [k for k in args.handlers if "tcp" in stores] + (["etcd"] if "etcd" in stores else [])
    if args.smoke:
        args.nodes = args.nodes or SMOKE_NODES
        args.repeats, args.torch_timeout = 1, min(args.torch_timeout, 60.0)
    nodes = sorted(set(args.nodes or DEFAULT_NODES))
    if nodes[0] < 3 or args.repeats < 1 or args.torch_timeout <= 0:
        ap.error("--nodes must each be >= 3 (two victims and a survivor), --repeats >= 1, --torch-timeout > 0")
    limit = raise_fd_limit()
    if limit < 2 * max(nodes) + 64:
        ap.error(f"open-file limit {limit} is too low for {max(nodes)} participants (needs {2 * max(nodes) + 64})")
    threading.stack_size(512 << 10)
    import logging

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # torch's handler keeps the first round's worker-store address and a new rank 0 never
    # publishes one: a spare waits forever (why trainer.elastic forgets it every round). Plain
    # torchrun users set this; the baseline does too (rank 0 publishes, the others read: 2 ops)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rec = Recorder(args.out, [str(Path(__file__).relative_to(REPO)) if Path(__file__).is_relative_to(REPO) else __file__,
                              *argv])
    failed: dict[str, tuple[int, str]] = {}
    import tempfile

    for n in nodes:
        for kind in handlers:
            if kind in failed:
                continue
            with tempfile.TemporaryDirectory(prefix="replacement-scale-") as work:
                server = EtcdServer(Path(work)) if kind == "etcd" else StoreServer()
                try:
                    err = measure_handler(kind, n, args.repeats, args.torch_timeout, server, rec, tuple(args.scenarios))
                finally:
                    server.stop()
            if err:
                failed[kind] = (n, err)
                print(f"  {kind:<8} N={n:<5} {err}", flush=True)
    name = args.report or REPORTS["etcd" in stores and not args.smoke]
    figures = summarise(rec.doc["rounds"], failed, nodes, protocol=name == REPORTS[0])
    for kind, (n, _) in failed.items():
        figures[f"{kind}_not_finished_nodes_count"] = n
    figures["load_average_ratio"] = round(os.getloadavg()[0], 2)
    _report.write(args.json, name, report_figures(name, figures))
    ok = [r for r in rec.doc["rounds"] if "error" not in r and r["handler"] in ("sentinel", "etcd")]
    return 0 if ok and all(r["ranks_complete"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
