"""The job's own view of its health, as its ranks report it to the node's daemon: hangs and
stragglers turned into trips. Decides only (no I/O, no clock: time is passed in).

* A ``hang`` report whose verdict names this node (its ``hosts`` holds the daemon's node name)
  trips rule ``hang`` with action ``migrate``: the node is handed over *without* asking its ranks
  for a snapshot (they are the ones stuck; see :meth:`sentinel.migration.Migrator.begin`), the
  others have abandoned the collective and resume from the memory tier. A verdict naming another
  node, or none (``unknown``), is kept for the metrics and ``sentinel status`` only.
* A ``straggler`` report (the job's progress exchange scored this node slow) is joined with
  this node's GPU readings — clock-event reasons, PCIe replays per minute since the previous
  poll, link width against the widest seen, NVLink errors per minute — so the trip says why, and
  :func:`sentinel.straggler.decide` picks ``migrate`` only when the saving over the steps left
  exceeds the measured hand-over cost, else ``alert``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from sentinel.channel import MAX_RANK, MAX_STEP
from sentinel.families import counter, gauge
from sentinel.policy import NODE, Trip
from sentinel.readings import GpuReading
from sentinel.settings import printable
from sentinel.straggler import GpuEvidence, StragglerSettings, causes, decide

# The measured hand-over: trip to the first step on a warm spare (bench/migration.py,
# docs/measured.json "warm_spare_trip_to_first_step_seconds", 1.135 s on the 2-CPU reference
# host) is far below what a real job pays; a real job's restart (rendezvous, process group,
# restore) grows with its size (docs/goodput.md). 60 s is the conservative default.
DEFAULT_HANDOVER_SECONDS = 60.0
# A straggler score or step time past these is no measurement (the channel's JSON carries any
# float, NaN and Infinity included, and integers of thousands of digits): the report is malformed.
MAX_SCORE = 1e6
MAX_STEP_SECONDS = 1e6

JOB_REPORTS = counter("sentinel_job_reports", "Reports the job's ranks sent this daemon, by kind (hang verdicts, straggler scores)",
                      "kind")
HANG_CULPRIT_HERE = gauge("sentinel_job_hang_culprit_here",
                          "1 when the newest hang verdict the job reported names a rank on this node")
STRAGGLER_SCORE = gauge("sentinel_job_straggler_score",
                        "This node's straggler score: relative (its compute time over the job's median) and "
                        "individual (over its own best)", "kind")
RENDEZVOUS_STORE_UP = gauge("sentinel_job_rendezvous_store_up",
                            "0 once this node's agent reported that the job's rendezvous store cannot be reached "
                            "(the job cannot take a new membership); left out until an agent reports")
STRAGGLER_CAUSE = gauge("sentinel_job_straggler_cause_info",
                        "Why this node is slow, as its GPUs report it (clock-event reasons, PCIe, NVLink); "
                        "cause=none when nothing was seen", "cause")


@dataclass
class _Previous:
    time: float
    pcie_replay: float | None
    nvlink: float | None


def _nvlink_errors(g: GpuReading) -> float | None:
    if not g.nvlink:
        return None
    return float(sum(v for kind, v in g.nvlink_sums.items() if kind in ("replay", "recovery", "crc_flit", "crc_data")))


@dataclass
class JobHealth:
    FAMILIES = (JOB_REPORTS, HANG_CULPRIT_HERE, STRAGGLER_SCORE, STRAGGLER_CAUSE,  # not a field: no annotation
                RENDEZVOUS_STORE_UP)

    node: str
    settings: StragglerSettings = field(default_factory=StragglerSettings)
    handover_seconds: float = DEFAULT_HANDOVER_SECONDS
    hang: dict[str, Any] | None = None  # the newest hang verdict a rank reported
    straggler: dict[str, Any] | None = None  # the newest straggler report, with causes and decision
    rendezvous: dict[str, Any] | None = None  # the agent's word on the rendezvous store (it cannot be reached)
    counts: dict[str, int] = field(default_factory=dict)
    _previous: dict[int, _Previous] = field(default_factory=dict)
    _widest: dict[int, float] = field(default_factory=dict)
    _evidence: list[GpuEvidence] = field(default_factory=list)
    _now: float = 0.0
    # a straggler report older than this no longer shows in the gauges (reports come every
    # progress exchange while the node stays slow)
    stale_seconds: float = 300.0

    def readings(self, gpus: Iterable[GpuReading], now: float) -> None:
        """Each poll: keep what the straggler causes need (rates since the previous poll)."""
        self._now = now
        evidence = []
        for g in gpus:
            v = g.values
            prev = self._previous.get(g.index)
            replay = v.get("pcie_replay")
            nvl = _nvlink_errors(g)
            minutes = (now - prev.time) / 60.0 if prev is not None else 0.0
            width = v.get("pcie_link_width")
            if width is not None:
                self._widest[g.index] = max(self._widest.get(g.index, 0.0), width)
            evidence.append(GpuEvidence(
                g.index,
                clock_event_reasons=int(v["throttle_reasons"]) if "throttle_reasons" in v else None,
                pcie_replays=(replay - prev.pcie_replay) if minutes > 0 and replay is not None and prev.pcie_replay is not None else None,
                pcie_link_width=width, pcie_link_width_max=self._widest.get(g.index),
                nvlink_errors=(nvl - prev.nvlink) if minutes > 0 and nvl is not None and prev.nvlink is not None else None,
                minutes=max(minutes, 1e-6)))
            self._previous[g.index] = _Previous(now, replay, nvl)
        self._evidence = evidence

    def observe(self, reports: Iterable[Any], now: float) -> list[Trip]:
        """Reports (:class:`sentinel.channel.Report`) received this poll -> trips."""
        trips: list[Trip] = []
        for rep in reports:
            self.counts[rep.kind] = self.counts.get(rep.kind, 0) + 1
            if rep.kind == "rendezvous":
                self._rendezvous(rep, now)
                continue
            if rep.kind == "hang":
                trip = self._hang(rep, now)
            else:
                trip = self._straggler(rep, now)
            if trip is not None and all(t.rule != trip.rule for t in trips):
                trips.append(trip)
        return trips

    def _hang(self, rep: Any, now: float) -> Trip | None:
        d = rep.detail
        # the job's words, printed by `sentinel status` on root's terminal and in the trip's log line:
        # bounded and escaped (a host name is compared as sent: a real one is printable already)
        raw_hosts, raw_culprits = d.get("hosts"), d.get("culprits")
        hosts = [printable(h[:253]) for h in (raw_hosts if isinstance(raw_hosts, list) else [])[:64] if isinstance(h, str)]
        culprits = [c for c in (raw_culprits if isinstance(raw_culprits, list) else [])[:64]
                    if isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_RANK]
        evidence = printable(str(d.get("evidence", ""))[:400])
        self.hang = {"time": now, "kind": printable(str(d.get("kind", ""))[:32]), "culprits": culprits, "hosts": hosts,
                     "evidence": evidence, "here": self.node in hosts, "reported_by": rep.rank, "step": rep.step}
        if self.node not in hosts or d.get("kind") not in ("stopped", "not_entered", "behind"):
            return None
        here = sorted(culprits)
        return Trip("hang", "migrate", NODE, "hang", f"hung collective: culprit rank(s) {here} on {self.node} "
                    f"({d.get('kind')}): {evidence[:300]}",
                    values={"culprit_rank": float(here[0]) if here else -1.0, "step": float(rep.step)})

    def _rendezvous(self, rep: Any, now: float) -> None:
        """The agent (trainer.elastic) could not reach the job's rendezvous store: shown in status
        and /metrics, no trip (nothing this node's hand-over could fix)."""
        d = rep.detail
        store, error = d.get("store"), d.get("error", "")
        if not isinstance(store, str) or not isinstance(error, str) or not isinstance(d.get("reachable"), bool):
            self.counts["rendezvous_malformed"] = self.counts.get("rendezvous_malformed", 0) + 1
            return
        # the job's own words, shown on an operator's terminal by `sentinel status`: no escape sequences
        self.rendezvous = {"time": now, "store": printable(store[:200]), "reachable": d["reachable"],
                           "error": printable(error[:300]),
                           "reported_by_pid": rep.pid}

    def _straggler(self, rep: Any, now: float) -> Trip | None:
        d = rep.detail
        try:
            relative = float(d["relative"])
            individual = float(d.get("individual", 1.0))
            step_seconds = float(d["step_seconds"])
            if not (0 < relative <= MAX_SCORE and 0 < individual <= MAX_SCORE and 0 <= step_seconds <= MAX_STEP_SECONDS):
                raise ValueError("out of range")  # NaN fails every comparison
        except (KeyError, TypeError, ValueError, OverflowError):
            self.counts["straggler_malformed"] = self.counts.get("straggler_malformed", 0) + 1
            return None
        steps_left = d.get("steps_left")
        steps_left = steps_left if isinstance(steps_left, int) and not isinstance(steps_left, bool) else None
        if steps_left is not None and not 0 <= steps_left <= MAX_STEP:
            self.counts["straggler_malformed"] = self.counts.get("straggler_malformed", 0) + 1
            return None
        link = d.get("link_relative")  # a slow link: this node's link time over the job's median
        link = (float(link) if isinstance(link, (int, float)) and not isinstance(link, bool) and 0 < link <= MAX_SCORE
                else None)
        why = causes(self._evidence, self.settings) + ([f"network link {link:.1f}x slower than the job's median"]
                                                        if link is not None else [])
        verdict = decide(relative, step_seconds, steps_left, self.handover_seconds)
        self.straggler = {"time": now, "relative": relative, "individual": individual, "step_seconds": step_seconds,
                          "steps_left": steps_left, "causes": why, "action": verdict.action, "why": verdict.why,
                          "step": rep.step, "link_relative": link}
        cause = "; ".join(why) if why else "no hardware cause seen (host, input pipeline or a noisy neighbour)"
        what = (f"the job runs {relative:.2f}x slower than its best" if link is not None
                else f"{relative:.2f}x the job's median compute")
        return Trip("straggler", verdict.action, NODE, "straggler", f"straggler: {what} ({cause}); {verdict.why}",
                    values={"relative": relative, "individual": individual})

    def gauges(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        if self.hang is not None:  # left out until the job reported a verdict (most nodes, always)
            out[HANG_CULPRIT_HERE.key()] = 1.0 if self.hang["here"] else 0.0
        if self.rendezvous is not None:
            out[RENDEZVOUS_STORE_UP.key()] = 1.0 if self.rendezvous["reachable"] else 0.0
        if self.straggler is not None and self._now - self.straggler["time"] <= self.stale_seconds:
            out[STRAGGLER_SCORE.key(kind="relative")] = self.straggler["relative"]
            out[STRAGGLER_SCORE.key(kind="individual")] = self.straggler["individual"]
            for c in self.straggler["causes"] or ["none"]:
                out[STRAGGLER_CAUSE.key(cause=c)] = 1.0
        return out

    def metric_counters(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {JOB_REPORTS.key(kind=k): float(n) for k, n in self.counts.items()}

    def status(self) -> dict[str, Any]:
        return {"hang": self.hang, "straggler": self.straggler, "rendezvous": self.rendezvous}


def status_lines(job: dict) -> list[str]:
    """The job's own health in ``sentinel status``: the newest hang verdict and straggler score."""
    out = []
    hang = job.get("hang") if isinstance(job, dict) else None
    if isinstance(hang, dict):
        where = "this node" if hang.get("here") else ", ".join(map(str, hang.get("hosts") or [])) or "-"
        out.append(f"hang: {hang.get('kind')} at step {hang.get('step')}: culprit rank(s) "
                   f"{hang.get('culprits')} on {where}: {hang.get('evidence')}")
    rdzv = job.get("rendezvous") if isinstance(job, dict) else None
    if isinstance(rdzv, dict) and rdzv.get("reachable") is False:
        out.append(f"rendezvous store {rdzv.get('store')} cannot be reached ({rdzv.get('error')}): this job cannot "
                   "take a new membership (a node's hand-over, a restart) without it")
    st = job.get("straggler") if isinstance(job, dict) else None
    if isinstance(st, dict):
        causes = "; ".join(map(str, st.get("causes") or [])) or "no hardware cause seen"
        what = (f"the job runs {st.get('relative', 0):.2f}x slower than its best" if st.get("link_relative")
                else f"{st.get('relative', 0):.2f}x the job's median compute ({st.get('individual', 0):.2f}x its own best)")
        out.append(f"straggler: {what} at step {st.get('step')}: {causes} -> {st.get('action')}: {st.get('why')}")
    return out
