"""Where the suite's CPU went: ``python tests/cpu_report.py FILE [N]`` reads what the suite wrote
with ``SENTINEL_TEST_CPU=FILE`` (tests/conftest.py) and prints the N costliest files and tests, each
xdist group's sum (a group runs on one worker: its wall sum bounds the run from below), and each
worker's span (the last to end is the run's tail, and the tests it ran last)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str, top: int = 25) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        f = per_file[row["test"].split("::")[0]]
        f[0] += row["cpu_s"]
        f[1] += row["wall_s"]
        f[2] += 1
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU-s in tests (wall on 2 cores >= {total / 2:.0f} s)\n")
    print(f"{'file':48} {'tests':>5} {'CPU-s':>7} {'wall-s':>7} {'share':>6}")
    for name, (cpu, wall, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{name:48} {n:5d} {cpu:7.1f} {wall:7.1f} {cpu / total:6.1%}")
    print(f"\n{'test':100} {'CPU-s':>7} {'wall-s':>7}")
    for row in sorted(rows, key=lambda r: -r["cpu_s"])[:top]:
        print(f"{row['test'][:100]:100} {row['cpu_s']:7.1f} {row['wall_s']:7.1f}")
    if all("start" in r for r in rows):  # written since the rows carry their start, worker and group
        timeline(rows)
    if all("host_cpu" in r for r in rows):
        host(rows, total)


def host(rows: list[dict], tests_cpu: float) -> None:
    """The host's CPU from the first test's start to the last test's end: busy against the tests' own
    (the rest: processes nobody waited for, other users), idle (the workers all waiting: more
    workers would fill it)."""
    start = min(r["host_cpu"][0] for r in rows)  # [busy, idle] at the first test's start
    end = max(r["host_cpu"][1] for r in rows)  # at the last test's end
    busy, idle = end[0] - start[0], end[1] - start[1]
    if busy <= 0:
        return
    print(f"\nhost CPU over the run: {busy:.0f} s busy, {idle:.0f} s idle ({idle / max(busy + idle, 1e-9):.0%} idle); "
          f"the tests' own CPU is {tests_cpu / max(busy, 1e-9):.0%} of the busy seconds")


def timeline(rows: list[dict]) -> None:
    t0 = min(r["start"] for r in rows)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        g = groups[row.get("group") or "(none)"]
        g[0] += row["cpu_s"]
        g[1] += row["wall_s"]
        g[2] += 1
    print(f"\n{'xdist group':48} {'tests':>5} {'CPU-s':>7} {'wall-s':>7}")
    for name, (cpu, wall, n) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:48} {n:5d} {cpu:7.1f} {wall:7.1f}")
    workers: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        workers[row["worker"]].append(row)
    print(f"\n{'worker':10} {'tests':>5} {'busy-s':>7} {'ends at':>8}  its last three tests (start s, wall s)")
    for name, mine in sorted(workers.items()):
        mine.sort(key=lambda r: r["start"])
        end = max(r["start"] + r["wall_s"] for r in mine) - t0
        last = ", ".join(f"{r['test'].split('::')[-1][:40]} ({r['start'] - t0:.0f}, {r['wall_s']:.0f})" for r in mine[-3:])
        print(f"{name:10} {len(mine):5d} {sum(r['wall_s'] for r in mine):7.0f} {end:8.0f}  {last}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
