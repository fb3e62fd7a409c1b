"""What finding the node's ranks costs the daemon, with and without junk in ``ranks/``.

``DaemonEndpoint.ranks()`` looks every process's canonical ``<pid>.sock`` up by name and then
reads at most ``4 x max_ranks`` directory entries for alternative names and junk (removed when it
can be). Cases, side by side in one run, one verified rank (this process):

* clean       — only the rank's socket;
* removable   — 4,200 planted plain files, re-planted before every call (each call removes up to
                4,096: the worst case for an attacker who keeps planting);
* kept        — 4,200 planted non-empty directories (junk the daemon never removes: each call
                reads 4,096 entries and the rank is still found by name).

Prints the median and the ratio to ``clean``. Run as root (the daemon's view)::

    python bench/rank_scan.py [--calls 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import add_json_argument, write  # noqa: E402
from sentinel.channel import RankEndpoint  # noqa: E402
from sentinel.daemon_endpoint import DaemonEndpoint  # noqa: E402
from sentinel.procs import AgentRecord, write_agent_record  # noqa: E402

PLANTED = 4200


def plant_files(ranks: Path) -> None:
    for i in range(2, 2 + PLANTED):
        (ranks / f"{i + 5_000_000}.sock").touch()


def plant_dirs(ranks: Path) -> None:
    for i in range(PLANTED):
        d = ranks / f"junk{i}"
        d.mkdir()
        (d / "x").touch()


def measure(ep: DaemonEndpoint, calls: int, before=None) -> float:
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        found = ep.ranks()
        times.append(time.perf_counter() - t0)
        assert os.getpid() in found, "the rank was not found"
    return statistics.median(times)


SMOKE_FIGURES = ("rank_scan_clean_seconds", "rank_scan_removable_4200_seconds", "rank_scan_kept_4200_seconds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    add_json_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # 3 calls per case: that it runs (tests/test_bench_smoke.py)
        args.calls = 3
    root = Path(tempfile.mkdtemp(prefix="sentinel-bench-scan-"))
    try:
        ep = DaemonEndpoint(root)
        write_agent_record(root / "agent.pid", AgentRecord.of(os.getpid()))
        rank = RankEndpoint.open(root)
        ranks = root / "ranks"
        clean = measure(ep, args.calls)
        removable = measure(ep, args.calls, before=lambda: plant_files(ranks))
        for p in ranks.iterdir():
            if p.name != rank.path.name:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        plant_dirs(ranks)
        kept = measure(ep, args.calls)
        rank.close()
        ep.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"DaemonEndpoint.ranks(), median of {args.calls} calls, {len(os.listdir('/proc'))} /proc entries")
    print(f"{'case':<12} {'median ms':>10} {'x clean':>8}")
    for name, value in (("clean", clean), ("removable", removable), ("kept", kept)):
        print(f"{name:<12} {value * 1e3:>10.2f} {value / clean:>8.1f}")
    write(args.json, "rank_scan", {"rank_scan_clean_seconds": clean, "rank_scan_removable_4200_seconds": removable,
                                        "rank_scan_kept_4200_seconds": kept})
    return 0


if __name__ == "__main__":
    sys.exit(main())
