"""Progress from every rank, with no user code: step times, the compute/communication split, and
the hang watch. Used by :class:`trainer.guard.SnapshotGuard`; usable on its own.

Contract
--------
* :meth:`Progress.on_step` is called by ``guard.step(step)`` once per step. It records the wall
  time of the step boundary (one ``perf_counter`` and a deque append) and tells the hang watch
  that a step completed. Every ``every`` steps it is collective (the guard calls it on every rank
  at the same step): the ranks exchange one small float64 vector each (``all_gather`` on the
  guard's *control* group — never the training group, which may be the hung one) and every rank
  then holds the job's progress: per rank its step, median step time, median compute time and
  communication time over the window.
* Compute vs communication comes from torch's flight recorder where it is on
  (``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 when the process group was
  created; gloo and NCCL alike in torch 2.13). Every collective a rank entered in the window has
  its entry time there; one all_reduce MAX on the control group gives each the job's latest
  entry, so each rank knows how long it waited in every collective for the last rank to enter.
  A rank's *compute* time in a step is the step time less those waits: the slowest rank, whom
  everyone waits for, keeps its whole step. (Entry times are wall clocks: ranks on different
  hosts compare them to within their clock sync, NTP's milliseconds or PTP's microseconds.)
  Without the recorder the split is unknown and the step time stands in for compute (the scores
  then only see a slow node through its individual score). The groups the guard uses from
  background threads (disk save, memory replica) are excluded; the control group, used by the
  training thread, counts (but not the guard's per-step agreement on it: point-to-point messages,
  :mod:`trainer.agree`, which the recorder's parse leaves out). The dump is budgeted (``fr_budget`` of the window's time): the ranks
  agree to skip the same windows when it costs more, and a skipped window is not scored.
* :class:`HangWatch` is a daemon thread. When no step completed on this rank for T
  (:func:`sentinel.hang.hang_timeout`), it writes what this rank last entered (its last completed
  step, the flight recorder's last collective per group) into the job's rendezvous store (a key
  per rank, never a collective: a stopped rank simply does not write), waits ``gather_seconds``
  for the others, and decides with :func:`sentinel.hang.find_culprit`. The first rank to decide
  writes the verdict (``compare_set``), every rank uses that one. Then ``on_verdict`` runs:
  the guard reports to its node's daemon (the culprit's node hands itself over) and abandons the
  group (the process exits with :data:`EXIT_HANG`, so torchrun restarts the workers; they resume
  from the memory tier). A step completing meanwhile ends the suspicion (its key is deleted).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from statistics import median
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from sentinel.hang import (Entered, HangSettings, Verdict, find_culprit, hang_timeout, parse_flight_recorder,
                           settings_from_env)
from trainer.flight import (  # noqa: F401 - re-exported: trainer.progress's names from before the split
    FR_GROUPS, FR_SLOTS, dump_flight_recorder, flight_recorder_on, group_key, split_steps, window_entries)

log = logging.getLogger("sentinel.trainer.progress")

EXIT_HANG = 76  # the exit status of a rank that abandoned a hung collective
FIELDS = ("step", "step_seconds", "compute_seconds", "comm_seconds", "samples", "snapshot_steps", "since_start",
          "fr_skip", "link_seconds_per_mb", "link_from")


@dataclass
class JobProgress:
    """The job's progress after an exchange: per rank its node and figures."""

    step: int
    nodes: dict[int, str]
    figures: dict[int, dict[str, float]] = field(default_factory=dict)

    def node_compute(self) -> dict[str, float]:
        """Per node the compute time of its slowest rank (every rank waits for it)."""
        out: dict[str, float] = {}
        for r, f in self.figures.items():
            if f["samples"] > 0:
                n = self.nodes.get(r, str(r))
                out[n] = max(out.get(n, 0.0), f["compute_seconds"])
        return out


class Progress:
    """Per-rank step recorder plus the K-step exchange. ``group`` is the guard's control group
    (None outside a distributed job); ``exclude`` the flight-recorder names of the guard's groups."""

    def __init__(self, *, every: int = 10, group: Any = None, rank: int = 0, world: int = 1,
                 node: str | None = None, exclude: tuple[str, ...] = (), window: int = 64,
                 clock: Callable[[], float] = time.monotonic, wall_ns: Callable[[], int] = time.time_ns,
                 fr_budget: float = 0.01, link: Callable[[], tuple[float, int]] | None = None) -> None:
        if every < 1:
            raise ValueError("progress every must be >= 1")
        self.every = every
        self.group = group
        self.rank = rank
        self.world = world
        self.node = node or os.environ.get("SENTINEL_NODE") or socket.gethostname()
        self.exclude = set(exclude)
        self.clock = clock
        self.wall_ns = wall_ns
        self.step_seconds: deque[float] = deque(maxlen=window)
        self.boundaries: deque[tuple[int, int, bool]] = deque(maxlen=every + 1)
        self.last_step = -1
        self.last_done = clock()  # monotonic time of the last completed step (or of the start)
        self.steps_since_start = 0
        self.job: JobProgress | None = None
        self.nodes: dict[int, str] | None = None
        self.exchanges = 0
        self.exchange_seconds: list[float] = []
        self._last_wall: int | None = None
        self.fr = flight_recorder_on()
        self.fr_anywhere = self.fr  # whether any rank's flight recorder is on (agreed at the first exchange)
        self.fr_budget = fr_budget
        self.link = link or (lambda: (0.0, -1))  # (seconds per MB, from rank) of the last replica received
        self._fr_skip = 0
        self._want_skip = 0
        self._dumped = False
        self._inflight: dict[str, Any] | None = None  # the exchange whose collectives are running

    def on_step(self, step: int, *, snapshot: bool = False) -> JobProgress | None:
        """Record a completed step; collective every ``every`` steps (returns the job's progress then)."""
        now = self.clock()
        wall = self.wall_ns()
        if self._last_wall is not None:
            self.step_seconds.append((wall - self._last_wall) / 1e9)
        self._last_wall = wall
        self.boundaries.append((step, wall, snapshot))
        self.last_step = step
        self.last_done = now
        self.steps_since_start += 1
        job = self._advance()  # the exchange in flight moves on one phase a step; its collective ran meanwhile
        if self.steps_since_start % self.every != 0:
            return job
        while self._inflight is not None:  # every < 3: the previous exchange completes first
            job = self._advance() or job
        return self.exchange(step) or job

    def _entries(self, bounds: list[tuple[int, int, bool]]) -> dict[int, int] | None:
        """This rank's collective entries in the window, from its flight recorder; None when it is
        off, failed, or this window is skipped (the dump budget, agreed by every rank)."""
        self._dumped = False
        if not self.fr:
            return None
        if self._fr_skip > 0:
            self._fr_skip -= 1
            return None
        t0 = time.thread_time()  # this thread's CPU: what the dump costs the step, not the host's load
        self._dumped = True
        dump = dump_flight_recorder()
        try:
            traces = parse_flight_recorder(dump) if dump is not None else None
        except ValueError:
            traces = None
        entries = None if traces is None else window_entries(bounds, traces, self.exclude)
        # A dump walks the whole ring: keep it under fr_budget of the window's time by dumping only
        # every n-th window (the ranks agree on n after the exchange: every rank skips the same ones).
        cost = time.thread_time() - t0
        window = sum(list(self.step_seconds)[-self.every:])
        self._want_skip = min(8, int(cost / (self.fr_budget * window))) if window > 0 and cost > self.fr_budget * window else 0
        return entries

    def local_figures(self, bounds: list[tuple[int, int, bool]], entries: dict[int, int] | None,
                      latest: Mapping[int, float], since_start: int | None = None) -> list[float]:
        """This rank's compact progress over the window ending at ``bounds[-1]``: FIELDS, in order."""
        steps = bounds[1:]
        if entries is not None:
            plain = [x for x in split_steps(bounds, entries, latest) if not x[3]]
            step_s = median(x[1] for x in plain) if plain else 0.0
            compute = median(x[2] for x in plain) if plain else 0.0
            samples = len(plain)
        elif self.fr:  # a window the dump budget skipped: no figures, it is not scored
            step_s = compute = 0.0
            samples = 0
        else:  # no flight recorder: the step time stands in for compute
            recent = [x for x, b in zip(list(self.step_seconds)[-len(steps):], steps) if not b[2]] if steps else []
            step_s = compute = median(recent) if recent else 0.0
            samples = len(recent)
        snaps = sum(1 for b in steps if b[2])
        last = bounds[-1][0] if bounds else self.last_step
        since = self.steps_since_start if since_start is None else since_start
        return [float(last), step_s, compute, max(0.0, step_s - compute), float(samples), float(snaps),
                float(since), float(self._want_skip if self._dumped else 0), *map(float, self.link())]

    def exchange(self, step: int) -> JobProgress | None:
        """Start the exchange of the window ending at ``step`` (every rank at the same step). Two
        collectives on the control group, each issued asynchronously and waited for a step later,
        so that no step waits for the slowest rank to reach them: an all_reduce MAX of the entry
        times (phase 1; only when some rank's flight recorder is on, agreed at the first exchange:
        without one there are no entry times), then an all_gather of the figures (phase 2). Returns the job's progress
        when there is nobody to wait for (one rank), else None (:meth:`on_step` returns it)."""
        t0 = time.perf_counter()
        bounds = list(self.boundaries)
        entries = self._entries(bounds)
        if self.nodes is None:  # once: every rank's node name, and whether any rank has a flight recorder
            names: list[Any] = [(self.node, self.fr)]
            if self.group is not None and self.world > 1:
                names = [None] * self.world
                dist.all_gather_object(names, (self.node, self.fr), group=self.group)
            self.nodes = {r: str(n[0]) for r, n in enumerate(names)}
            self.fr_anywhere = any(bool(n[1]) for n in names)
        x = {"phase": 1, "step": step, "bounds": bounds, "entries": entries, "since": self.steps_since_start,
             "cost": 0.0, "work": None, "vec": None}
        if self.fr_anywhere:
            vec = torch.full((FR_GROUPS * FR_SLOTS,), -math.inf, dtype=torch.float64)
            for slot, ns in (entries or {}).items():
                vec[slot] = float(ns)
            x.update(vec=vec, work=self._async(dist.all_reduce, vec, op=dist.ReduceOp.MAX))
        else:  # no rank records entry times (agreed above): no latest entries to agree on, phase 2 at once
            self._gather_figures(x, {})
        x["cost"] = time.perf_counter() - t0
        self._inflight = x
        if self.group is None or self.world <= 1:
            job = None
            while self._inflight is not None:
                job = self._advance()
            return job
        return None

    def _async(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if self.group is None or self.world <= 1:
            return None
        return fn(*args, group=self.group, async_op=True, **kw)

    def _gather_figures(self, x: dict[str, Any], latest: Mapping[int, float]) -> None:
        """Phase 2 of the exchange ``x``: this rank's figures, all-gathered (asynchronously)."""
        mine = torch.tensor(self.local_figures(x["bounds"], x["entries"], latest, x["since"]), dtype=torch.float64)
        x["out"] = [torch.empty_like(mine) for _ in range(self.world)] if self.world > 1 and self.group is not None else [mine]
        x.update(phase=2, work=self._async(dist.all_gather, x["out"], mine))

    def _advance(self) -> JobProgress | None:
        """Move the exchange in flight on by one phase (see :meth:`exchange`); its progress once done."""
        x = self._inflight
        if x is None:
            return None
        t0 = time.perf_counter()
        if x["work"] is not None:
            x["work"].wait()
        if x["phase"] == 1:
            self._gather_figures(x, {slot: float(x["vec"][slot]) for slot in (x["entries"] or {})})
            x["cost"] += time.perf_counter() - t0
            return None
        job = JobProgress(x["step"], dict(self.nodes or {}))
        for r, t in enumerate(x["out"]):
            job.figures[r] = dict(zip(FIELDS, t.tolist()))
        if self._dumped:  # every rank that dumped takes the same skip: the median asked (one rank's spike is not the cost)
            self._fr_skip = int(median(f["fr_skip"] for f in job.figures.values()))
        self._inflight = None
        self.job = job
        self.exchanges += 1
        self.exchange_seconds.append(x["cost"] + time.perf_counter() - t0)
        del self.exchange_seconds[:-256]
        return job

    def finish(self, timeout: float = 30.0) -> None:
        """Complete the exchange in flight (at the end of training: every rank issued it)."""
        x = self._inflight
        if x is None or x["work"] is None:
            self._inflight = None
            return
        try:
            x["work"].wait(timedelta(seconds=timeout))
            if x["phase"] == 1:
                self._advance()
                if x["work"] is not None:  # phase 2's
                    x["work"].wait(timedelta(seconds=timeout))
            self._advance()
        except RuntimeError as exc:  # a peer already gone: nothing left to agree on
            log.warning("progress exchange in flight not completed at close: %s", exc)
        self._inflight = None

    def entered(self) -> Entered:
        """What this rank last entered (for the hang gather). Safe from another thread."""
        seqs: dict[str, int] = {}
        ops: dict[str, str] = {}
        dump = dump_flight_recorder()
        if dump is not None:
            try:
                for k, t in parse_flight_recorder(dump).items():
                    seqs[k], ops[k] = t.last_entered, t.last_op
            except ValueError as exc:
                log.warning("flight recorder dump not understood: %s", exc)
        return Entered(self.rank, self.node, os.getpid(), self.last_step, seqs, ops,
                       max(0.0, self.clock() - self.last_done))


class HangWatch:
    """The background watch (see the module docstring). ``store`` is a c10d Store shared by the
    job's ranks (the default group's); ``prefix`` a key prefix unique to this worker group."""

    def __init__(self, progress: Progress, store: Any, prefix: str, *, settings: HangSettings = HangSettings(),
                 on_verdict: Callable[[Verdict], None] | None = None, tick: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, on_suspect: Callable[[], None] | None = None) -> None:
        self.progress = progress
        self.store = store
        self.prefix = prefix.rstrip("/") + "/"
        self.settings = settings
        self.on_verdict = on_verdict
        self.on_suspect = on_suspect
        self.tick = tick
        self.clock = clock
        self.suspected_at: float | None = None
        self.verdict: Verdict | None = None
        self.timeout = hang_timeout([], settings)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sentinel-hang-watch", daemon=True)
        self._round = -1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # in a store call: a daemon thread inside torch at exit can abort the process
                log.warning("hang watch thread still running 5 s after stop")

    def _key(self, what: str) -> str:
        return f"{self.prefix}{what}"

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch never dies; a failed round is logged and retried
                log.exception("hang watch round failed")

    def check(self) -> Verdict | None:
        """One look: suspect, gather, decide. Returns the verdict once there is one."""
        p = self.progress
        if p.last_step < 0:
            return None  # armed at the first completed step: start-up, compile and restore are not hangs
        self.timeout = hang_timeout(list(p.step_seconds), self.settings)
        idle = self.clock() - p.last_done
        if idle < self.timeout:
            if self.suspected_at is not None:
                log.warning("hang suspicion over: rank %d completed step %d", p.rank, p.last_step)
                for r in (self._round, self._round + 1):
                    self.store.delete_key(self._key(f"report/{r}/{p.rank}"))
                self.suspected_at = None
                self.verdict = None
            return None
        if self.verdict is not None:
            return self.verdict
        round_ = p.last_step  # every answering rank completed the same step, or the one before
        self._round = round_
        if self.suspected_at is None:
            self.suspected_at = self.clock()
            log.error("no step completed for %.1f s (T = %.1f s) after step %d: suspecting a hang", idle,
                      self.timeout, p.last_step)
            if self.on_suspect is not None:
                self.on_suspect()
            mine = p.entered()
            for r in (round_, round_ + 1):  # a rank that finished a step more than we did looks in r+1
                self.store.set(self._key(f"report/{r}/{p.rank}"), mine.encode())
        verdict_key = self._key(f"verdict/{round_}")
        if self.store.check([verdict_key]):
            return self._decided(Verdict.decode(self.store.get(verdict_key)))
        if self.clock() - self.suspected_at < self.settings.gather_seconds:
            return None
        reports: dict[int, Entered | None] = {}
        for rank in range(p.world):
            got = None
            for r in (round_, round_ - 1, round_ + 1):
                key = self._key(f"report/{r}/{rank}")
                if self.store.check([key]):
                    try:
                        got = Entered.decode(self.store.get(key))
                    except ValueError as exc:
                        log.warning("ignoring a malformed hang report of rank %d: %s", rank, exc)
                    break
            reports[rank] = got
        verdict = find_culprit(reports, p.world, hosts=p.nodes or {})
        if not verdict.decided:
            # every rank inside the same collective: nothing to hand over on a guess. Said once;
            # the process-group timeout (or NCCL RAS on GPU nodes) takes it from here.
            return self._decided(verdict)
        # first writer wins: every rank acts on one verdict
        stored = self.store.compare_set(verdict_key, "", verdict.encode())
        return self._decided(Verdict.decode(stored))

    def _decided(self, verdict: Verdict) -> Verdict:
        self.verdict = verdict
        log.error("hang verdict: %s (culprit rank(s) %s on %s): %s", verdict.kind, list(verdict.culprits),
                  list(verdict.hosts), verdict.evidence)
        if self.on_verdict is not None:
            self.on_verdict(verdict)
        return verdict


class JobWatch:
    """What ``SnapshotGuard`` wires in: :class:`Progress` on the control group, a
    :class:`HangWatch` on the job's store, and straggler scoring on every exchange. Reports go to
    this node's daemon over the control channel (:class:`sentinel.channel.Report`).

    On a decided hang verdict every rank that can still run reports it (the culprit's node hands
    itself over; the others record it), waits ``gather_seconds`` so that every rank has read the
    verdict from the store, and abandons the collective: ``exit(EXIT_HANG)`` of the whole process
    (no torch backend can abort a gloo collective from another thread; for NCCL an abort would
    leave the same state), so torchrun restarts the workers and they resume from the memory tier.
    An undecided verdict (every rank in the same collective) is reported and the watch goes on."""

    def __init__(self, *, endpoint: Any, rank: int, world: int, control_group: Any, exclude: tuple[str, ...] = (),
                 every: int = 5, hang: HangSettings | None = None, total_steps: int | None = None,
                 straggler: Any = None, store: Any = None, prefix: str = "", node: str | None = None,
                 exit: Callable[[int], None] = os._exit, link: Callable[[], tuple[float, int]] | None = None) -> None:
        from sentinel.straggler import LINK_RELATIVE_THRESHOLD, StragglerSettings, StragglerTracker

        self.endpoint = endpoint
        self.total_steps = total_steps
        self.exit = exit
        self.progress = Progress(every=every, group=control_group, rank=rank, world=world, node=node, exclude=exclude,
                                 link=link)
        self.settings = straggler or StragglerSettings()
        self.tracker = StragglerTracker(self.settings)
        self.stragglers: list[Any] = []
        # slow links: the same rule on each node's link time (sentinel.straggler.node_link_seconds)
        self.link_tracker = StragglerTracker(dataclasses.replace(self.settings, relative_threshold=LINK_RELATIVE_THRESHOLD))
        self.link_stragglers: list[Any] = []
        self.last_links: dict[str, float] = {}  # the last window's link time per node (seconds per MB)
        self._best_step: float | None = None  # the job's best window step time: what a slow link slows
        # the last window scored: (step, node -> compute seconds, the nodes it named stragglers)
        self.last_window: tuple[int, dict[str, float], tuple[str, ...]] | None = None
        self.hang_settings = hang or settings_from_env(os.environ)
        self.watch: HangWatch | None = None
        self.inflight: Callable[[], Any] = lambda: None  # the guard's disk write in flight (JobWatch.open)
        self._seen_inflight: Any = None
        if store is not None and world > 1:
            self.watch = HangWatch(self.progress, store, prefix, settings=self.hang_settings, on_verdict=self._on_verdict,
                                   on_suspect=self._hold_exceptions)
            self.watch.start()
        self._excepthook: Any = None  # the hook _hold_exceptions replaced

    @classmethod
    def open(cls, guard: Any, **kw: Any) -> "JobWatch":
        """For ``guard`` (a SnapshotGuard): its control group, the flight-recorder names of its
        background groups (left out of the compute/communication split), the job's store and a key
        prefix agreed by every rank (collective, once)."""
        groups = [getattr(guard, "group", None), getattr(getattr(guard, "memory", None), "group", None)]
        exclude = tuple(k for k in (group_key(g) for g in groups if g is not None) if k)
        store = None
        prefix = ""
        if guard.distributed and guard.world > 1:
            try:
                store = dist.distributed_c10d._get_default_store()
            except (AttributeError, RuntimeError, ValueError) as exc:
                log.warning("no job store for the hang watch (%s): hangs are left to the process-group timeout", exc)
            box = [os.urandom(8).hex()]
            dist.broadcast_object_list(box, src=0, group=guard.control_group)
            prefix = f"sentinel/hang/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{box[0]}"
        memory = getattr(guard, "memory", None)
        watch = cls(endpoint=guard.endpoint, rank=guard.rank, world=guard.world, control_group=guard.control_group,
                    exclude=exclude, store=store, prefix=prefix,
                    link=memory.link_evidence if memory is not None else None, **kw)
        watch.inflight = lambda: getattr(guard, "_inflight", None)
        return watch

    def on_step(self, step: int, *, snapshot: bool | None = None) -> None:
        """After the guard's step. ``snapshot``: a disk snapshot started at this step (its stall is
        the guard's, not this node's speed); by default, whether the guard's write in flight is new."""
        if snapshot is None:
            now = self.inflight()
            snapshot, self._seen_inflight = now is not None and now is not self._seen_inflight, now
        job = self.progress.on_step(step, snapshot=snapshot)
        if job is None:
            return
        warm = {r: f for r, f in job.figures.items()  # the first window after a (re)start holds warm-up steps
                if f["since_start"] > self.settings.warmup_steps + self.progress.every}
        window: dict[str, list[float]] = {}
        for r, f in warm.items():
            if f["samples"] > 0:
                node = job.nodes.get(r, str(r))
                window[node] = [max(window.get(node, [0.0])[0], f["compute_seconds"])]
        step_s = max((f["step_seconds"] for f in job.figures.values()), default=0.0)
        if len(window) >= 2:
            self.stragglers = self.tracker.observe(window)
            self.last_window = (step, {n: v[0] for n, v in window.items()}, tuple(s.node for s in self.stragglers))
            for s in self.stragglers:
                if s.node == self.progress.node:
                    self._report(s, step, step_s, s.relative)
        self._score_links(job, warm, step, step_s)

    def _score_links(self, job: JobProgress, warm: Mapping[int, Mapping[str, float]], step: int, step_s: float) -> None:
        """Slow links: each rank's last replica received is a link between two nodes; a node named
        by the link rule is reported with the job's slowdown since its best window (what the
        hand-over would win back: the daemon decides whether that pays)."""
        from sentinel.straggler import node_link_seconds

        if step_s > 0:
            self._best_step = min(self._best_step or step_s, step_s)
        links = node_link_seconds((job.nodes.get(int(f["link_from"]), ""), job.nodes.get(r, str(r)), f["link_seconds_per_mb"])
                                  for r, f in warm.items() if f["link_from"] >= 0)
        if len(links) < 3:  # two nodes share their one link: neither end stands out
            return
        self.last_links = links
        self.link_stragglers = self.link_tracker.observe({n: [v] for n, v in links.items()})
        for s in self.link_stragglers:
            if s.node == self.progress.node:
                self._report(s, step, step_s, step_s / self._best_step if self._best_step else 1.0, link=True)

    def _report(self, s: Any, step: int, step_s: float, slowdown: float, *, link: bool = False) -> None:
        """Tell this node's daemon it is a straggler (``link``: its link, ``s.relative`` times the
        job's median link time); ``relative`` is the job's slowdown it causes, which the daemon's
        hand-over decision weighs."""
        from sentinel.channel import Report

        me = self.progress.node
        left = None if self.total_steps is None else max(0, self.total_steps - step - 1)
        what = "link time" if link else "compute"
        log.warning("this node (%s) is a straggler: %.2fx the job's median %s, %.2fx its own best", me, s.relative,
                    what, s.individual)
        detail = {"node": me, "relative": round(max(slowdown, 1e-6), 4), "individual": round(s.individual, 4),
                  "step_seconds": round(step_s, 6), "compute_seconds": round(s.compute_seconds, 6),
                  "job_median_seconds": round(s.job_median_seconds, 6), "steps_left": left}
        if link:
            detail["link_relative"] = round(s.relative, 4)
        self.endpoint.report(Report("straggler", self.progress.rank, step, detail))

    def _on_verdict(self, verdict: Verdict) -> None:
        from sentinel.channel import Report

        self.endpoint.report(Report("hang", self.progress.rank, self.progress.last_step, verdict.as_dict()))
        if not verdict.decided:
            return
        time.sleep(self.hang_settings.gather_seconds)  # every rank reads the verdict before the store may go
        log.error("abandoning the hung collective (exit %d): torchrun restarts the workers", EXIT_HANG)
        logging.shutdown()
        self.exit(EXIT_HANG)

    def _hold_exceptions(self) -> None:
        """On suspicion (the training thread is stuck in a collective): a peer that leaves on the
        verdict first closes its connections, and this rank's collective then fails before its own
        watch has left. That failure must not pre-empt the verdict: the training thread's uncaught
        exception waits for the watch to decide and leave (:data:`EXIT_HANG`, after reporting)."""
        if self._excepthook is None:
            self._excepthook = sys.excepthook
            sys.excepthook = self._after_verdict

    def _after_verdict(self, kind: type, value: BaseException, tb: Any) -> None:
        watch = self.watch
        wait = self.hang_settings.gather_seconds * 2 + (watch.tick * 4 if watch is not None else 0.0)
        deadline = time.monotonic() + wait
        while watch is not None and time.monotonic() < deadline:  # the watch thread leaves the process
            if watch.verdict is not None and not watch.verdict.decided:
                break
            time.sleep(0.05)
        if watch is not None and watch.verdict is not None and watch.verdict.decided:
            log.error("the training collective failed after the hang verdict (%s); leaving (exit %d)", kind.__name__,
                      EXIT_HANG)
            logging.shutdown()
            self.exit(EXIT_HANG)
            return
        (self._excepthook or sys.__excepthook__)(kind, value, tb)

    def close(self, *, finish: bool = True) -> None:
        """Stop watching. ``finish``: complete the exchange in flight (every rank reached the same
        last step); False on an error path, where a peer may be gone."""
        if finish:
            self.progress.finish()
        if self._excepthook is not None and sys.excepthook == self._after_verdict:
            sys.excepthook = self._excepthook
        if self.watch is not None:
            self.watch.stop()
