"""Scrape latency under load: render per scrape (prometheus_client.start_http_server, the old path)
against render once per poll (sentinel.exporter.MetricsServer), side by side in one run.

Each server runs in its own process, like the daemon: it polls simulated NVML for N GPUs (18
NVLink links each, a few Xids) every --poll-interval seconds and publishes a new View; the new
path also calls refresh(). This process then runs --scrapers concurrent scrapers (closed loop:
each sends its next request when the previous one ends) for --requests requests in total, with
the headers Prometheus 2.x sends (OpenMetrics preferred, gzip), and prints p50/p99/max latency.

    python bench/scrape_load.py [--gpus 8] [--scrapers 20] [--requests 4000] [--json PATH] [--smoke]

``--smoke``: 4 scrapers, 100 scrapes per path.

The scrapers share the machine's cores with the server, as they would not in production, so the
figures are upper bounds for the server's part.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
HEADERS = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
REQUEST = ("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: scrape_load\r\nConnection: close\r\n"
           + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items()) + "\r\n").encode()
PATHS = ("old", "new")


# -- the server side (a child process) ----------------------------------------------------------
def serve(path: str, gpus: int, poll_interval: float, state: str) -> None:
    from sentinel.config import PolicyConfig
    from sentinel.metrics import View, build_registry
    from sentinel.policy import Policy
    from sentinel.readings import NodeReadings, SourceHealth
    from sentinel.sources import simulated
    from sentinel.sources.nvml import NvmlSource

    simulated.write_state(state, simulated.healthy_state(gpus))
    for gpu in range(gpus):
        simulated.inject(state, gpu, ["xid=79", "ecc-sbe=+5"] if gpu % 3 == 0 else ["ecc-sbe=+1"])
    source = NvmlSource(simulated.SimulatedNvml(state))
    source.start()
    policy = Policy(PolicyConfig())
    current = View()
    from sentinel.actions import ACTIONS
    from sentinel.daemon_endpoint import CHANNEL_MESSAGES
    from sentinel.sources.kernel import KERNEL_EVENTS

    counters = {
        CHANNEL_MESSAGES.key(kind="snapshot", outcome="acked"): 4.0,
        KERNEL_EVENTS.key(source="kmsg", kind="xid"): 3.0,
        ACTIONS.key(action="notify", outcome="ok"): 2.0,
    }

    def publish() -> None:
        nonlocal current
        t0 = time.perf_counter()
        polled = tuple(source.poll())
        readings = NodeReadings(time=time.time(), driver_version=source.driver_version, gpus=polled,
                                sources={"nvml": SourceHealth(True, time.perf_counter() - t0),
                                         "kmsg": SourceHealth(True, 0.0001)})
        rule_active: dict = {}
        for g in polled:
            rule_active.update(policy.rule_active(g))
        current = View(readings, {g.index: 0 for g in polled}, {0: 5400.0}, {("xid", "migrate"): 1}, rule_active,
                       counters, {}, "bench-node")

    registry = build_registry(lambda: current, (CHANNEL_MESSAGES, KERNEL_EVENTS, ACTIONS))
    publish()
    if path == "old":
        from prometheus_client import start_http_server

        httpd, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        port, refresh = httpd.server_port, (lambda: None)
    else:
        from sentinel.exporter import MetricsServer

        server = MetricsServer(registry, listen_address="127.0.0.1", port=0)
        server.start()
        port, refresh = server.port, server.refresh
    refresh()
    print(port, flush=True)
    while True:  # ends when the parent kills this process
        time.sleep(poll_interval)
        publish()
        refresh()


# -- the scraper side ---------------------------------------------------------------------------
def scrape(port: int, timeout: float) -> tuple[float, str | None, int]:
    """One scrape over a raw socket: http.client's header parsing would cost the scrapers (who
    share the CPUs with the server here) more than the new server spends per scrape."""
    t0 = time.perf_counter()
    chunks = []
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(REQUEST)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
    except OSError as exc:  # timeouts, resets, refused
        return time.perf_counter() - t0, type(exc).__name__, 0
    seconds = time.perf_counter() - t0
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    length = [ln.split(b":", 1)[1].strip() for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
    if status != [b"200"]:
        return seconds, f"HTTP {status[0].decode() if status else '?'}", len(body)
    if length and int(length[0]) != len(body):
        return seconds, "truncated body", len(body)
    return seconds, None, len(body)


def load(port: int, scrapers: int, requests: int, timeout: float) -> dict[str, float]:
    latencies: list[float] = []
    errors: list[str] = []
    sizes: list[int] = []
    lock = threading.Lock()
    remaining = [requests]

    def worker() -> None:
        while True:
            with lock:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            seconds, error, size = scrape(port, timeout)
            with lock:
                latencies.append(seconds)
                sizes.append(size)
                if error:
                    errors.append(error)

    for _ in range(scrapers):  # warm-up: one scrape each, not measured
        scrape(port, timeout)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout * requests)  # bounded: every request ends within its timeout
    wall = time.perf_counter() - t0
    latencies.sort()
    ms = lambda q: 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {
        "requests": len(latencies),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "p50_ms": round(ms(0.50), 2),
        "p99_ms": round(ms(0.99), 2),
        "max_ms": round(1000 * latencies[-1], 2),
        "mean_ms": round(1000 * statistics.fmean(latencies), 2),
        "scrapes_per_second": round(len(latencies) / wall, 1),
        "body_bytes": int(statistics.median(sizes)),
    }


def run_path(path: str, args: argparse.Namespace, workdir: str) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", path, "--gpus", str(args.gpus),
                             "--poll-interval", str(args.poll_interval), "--state", f"{workdir}/{path}.json"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the port, once listening
        if not line.strip().isdigit():
            raise SystemExit(f"{path} server did not start (exit {proc.poll()})")
        time.sleep(min(args.poll_interval, 1.0))  # past the first poll after start
        return load(int(line), args.scrapers, args.requests, args.timeout)
    finally:
        proc.kill()
        proc.wait(timeout=10)


SMOKE_FIGURES = tuple(f"{p}_scrape_{q}_seconds" for p in ("old", "new") for q in ("p50", "p99", "max", "mean")) + tuple(
    f"{p}_{k}" for p in ("old", "new") for k in ("errors_count", "scrapes_per_second", "body_bytes")) + tuple(
    f"old_over_new_{q}_ratio" for q in ("p50", "p99", "max")) + ("scrapers_count", "gpus_count")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--scrapers", type=int, default=20)
    parser.add_argument("--requests", type=int, default=4000, help="total scrapes per path")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=5.0, help="a scrape slower than this is an error")
    _report.add_json_argument(parser)
    parser.add_argument("--serve", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.scrapers, args.requests = 4, 100
    if args.serve:
        serve(args.serve, args.gpus, args.poll_interval, args.state)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        results = {path: run_path(path, args, workdir) for path in PATHS}
    old, new = results["old"], results["new"]
    ratio = {k: round(old[k] / new[k], 1) if new[k] else None for k in ("p50_ms", "p99_ms", "max_ms")}
    print(f"{args.scrapers} concurrent scrapers, {args.requests} scrapes per path, {args.gpus} simulated GPUs, "
          f"{os.cpu_count()} CPUs, Prometheus 2.x Accept (OpenMetrics) + gzip")
    print(f"{'path':<34}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'errors':>8}{'scrapes/s':>11}{'bytes':>8}")
    names = {"old": "old: render per scrape", "new": "new: render once per poll"}
    for path in PATHS:
        r = results[path]
        print(f"{names[path]:<34}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['max_ms']:>9}{r['errors']:>8}"
              f"{r['scrapes_per_second']:>11}{r['body_bytes']:>8}")
    print(f"{'old / new':<34}{ratio['p50_ms']:>8}x{ratio['p99_ms']:>8}x{ratio['max_ms']:>8}x")
    for path in PATHS:
        if results[path]["error_kinds"]:
            print(f"{path} errors: {', '.join(results[path]['error_kinds'])}")
    figures: dict[str, float] = {}
    for path in PATHS:
        r = results[path]
        for q in ("p50", "p99", "max", "mean"):
            figures[f"{path}_scrape_{q}_seconds"] = r[f"{q}_ms"] / 1e3
        figures[f"{path}_errors_count"] = r["errors"]
        figures[f"{path}_scrapes_per_second"] = r["scrapes_per_second"]
        figures[f"{path}_body_bytes"] = r["body_bytes"]
    for q in ("p50", "p99", "max"):
        figures[f"old_over_new_{q}_ratio"] = ratio[f"{q}_ms"]
    figures.update({"scrapers_count": args.scrapers, "gpus_count": args.gpus})
    _report.write(args.json, "scrape_load", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
