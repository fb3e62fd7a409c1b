"""Wiring only: build sources, policy, actions and exporters from config; run the loop.

Data flows one way: sources -> policy -> actions -> exporters. The loop never dies on a failed
source or action: it logs, counts and goes on. The systemd watchdog is pinged only after a
complete, successful iteration, so a hung loop gets the daemon restarted.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Protocol

from sentinel.actions import ACTIONS, Executor
from sentinel.config import Config
from sentinel.families import Family, counter, gauge
from sentinel.fsutil import UnsafePath, ensure_private_dir, probe_writable, write_json_atomic
from sentinel.jobhealth import JobHealth
from sentinel import rdzv_store
from sentinel.peers import NullPeers, PeerError
from sentinel.peers import from_config as peers_from_config
from sentinel.log import event
from sentinel.metrics import View, build_registry
from sentinel.policy import Health, Policy, PolicyState
import dataclasses

from sentinel.readings import KernelEvent, NodeReadings, SourceHealth, XidEvent
from sentinel.sources.nvml import NvmlSource, NvmlUnavailable
from sentinel.systemd import Notifier

log = logging.getLogger("sentinel.daemon")


CONFIG_RELOADS = counter("sentinel_config_reloads", "Config reloads by outcome", "outcome")
LOOP_ERRORS = counter("sentinel_loop_errors",
                      "Exceptions the daemon's loop caught and survived, by component (source, policy, actions, ...)",
                      "component")
NVML_INIT_FAILURES = counter("sentinel_nvml_init_failures", "Failed nvmlInit attempts (retried with backoff)")
LAST_POLL = gauge("sentinel_last_poll_timestamp_seconds", "Time of the last completed poll")
# Kernel events between polls are decided on at once, but at most once in this many seconds: the
# first event after a quiet spell waits for nothing, the events of a storm (1,000 Xids a second)
# gather for this long and are decided on together, every one of them (bench/poll_overhead.py).
EVENT_BATCH_SECONDS = 0.2


class StartupError(RuntimeError):
    """The daemon cannot start; the message is one clear sentence."""


class EventSource(Protocol):
    """A kernel-event source (eBPF probe or /dev/kmsg fallback); see sentinel.sources.kernel."""

    name: str
    wake: Callable[[], None]

    def set_gpus(self, bus_to_gpu: dict[str, int]) -> None: ...
    def start(self) -> None: ...
    def drain(self) -> tuple[list[XidEvent], list[KernelEvent]]: ...
    def health(self) -> dict[str, SourceHealth]: ...
    def counters(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]: ...
    def close(self) -> None: ...


def check_directories(runtime_dir: Path, state_dir: Path) -> None:
    """Refuse to start (StartupError naming the path and the fix) unless both directories are
    root-owned, writable by nobody else (sshd StrictModes), and writable by the daemon now."""
    for path, what, mode in ((runtime_dir, "runtime directory", 0o755), (state_dir, "state directory", 0o750)):
        try:
            ensure_private_dir(path, what, mode=mode)
        except UnsafePath as exc:
            raise StartupError(f"refusing to start: {exc}") from None
        except OSError as exc:
            raise StartupError(f"{what} {path} cannot be created: {exc.strerror}") from None
        try:
            probe_writable(path)
        except OSError as exc:
            raise StartupError(f"{what} {path} is not writable: {exc.strerror}") from None


class Daemon:
    def __init__(
        self,
        config: Config,
        nvml_source: NvmlSource,
        *,
        event_sources: list[EventSource] | None = None,
        executor: Executor | None = None,
        endpoint: Any = None,
        migrator: Any = None,
        notifier: Notifier | None = None,
        wake: threading.Event | None = None,
        urgent: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """Everything the daemon runs is passed in (:func:`sentinel.builder.build_daemon` wires it
        from config): the NVML source, the kernel-event sources, the executor of the policy's
        trips, the control channel to the ranks (``endpoint``, a
        :class:`sentinel.daemon_endpoint.DaemonEndpoint`), the migration sequence (``migrator``, a
        :class:`sentinel.migration.Migrator`), and ``wake``, the event that ends the wait between
        polls (set by a kernel event or a finished backend call; the builder gives the same one
        to the migrator), and ``urgent``, set beside it when what woke the loop is a step of a
        migration (an acknowledgement, a finished backend call): acted on at once, never
        gathered with a burst of kernel events. Without an endpoint and a migrator, trips are
        only counted and logged."""
        self.config = config
        self.nvml = nvml_source
        self.event_sources = list(event_sources or [])
        self.executor = executor or Executor()
        self.notifier = notifier or Notifier("")
        self.clock = clock
        self.wall = wall
        self.policy = Policy(config.policy)
        self.policy_state = PolicyState()
        self.trips: Counter[tuple[str, str]] = Counter()
        self.reloads: Counter[str] = Counter()
        self.view = View()
        self.iterations = 0
        self.errors: Counter[str] = Counter()  # component -> exceptions caught by the loop
        self.node = config.daemon.node_name or socket.gethostname()
        self.runtime_dir = Path(config.daemon.runtime_dir)
        self.httpd: Any = None
        self.metrics_port: int | None = None
        self.endpoint = endpoint
        self.migrator = migrator
        self._stop = threading.Event()
        self._wake = wake or threading.Event()
        self._urgent = urgent or threading.Event()
        self.last_gpus: tuple = ()
        self.started_at = clock()
        # NVML that cannot start (no driver, a broken one) is a reading, not an exit: the daemon
        # stays up, exports sentinel_source_up{source="nvml"} 0 and retries nvmlInit with backoff
        self.nvml_started = False
        self.nvml_problem = ""
        self.nvml_init_failures = 0
        self._nvml_retry_at = 0.0
        self._nvml_retry_delay = 0.0
        self.last_poll: float | None = None  # monotonic time of the last completed full poll
        # the job's hang and straggler reports (sentinel.jobhealth), read off the channel with the acks
        self.jobhealth = JobHealth(self.node, handover_seconds=config.job.handover_seconds)
        # verdicts naming another node go to that node's daemon (sentinel.peers; off by default)
        self.peers: Any = NullPeers()
        # the job's etcd rendezvous as this node sees it (sentinel.rdzv_store; off by default)
        self.rdzv_store: Any = rdzv_store.NullRendezvousStore() if not config.job.rendezvous_etcd_endpoints else \
            rdzv_store.RendezvousStoreWatch(list(config.job.rendezvous_etcd_endpoints))  # its families; start() loads TLS

    # -- start/stop ---------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the metrics listener, start NVML, first poll; READY only after all of that."""
        check_directories(self.runtime_dir, Path(self.config.daemon.state_dir))
        from sentinel.exporter import MetricsServer

        self.httpd = MetricsServer.from_config(build_registry(lambda: self.view, self.metric_families()), self.config.metrics,
                                               health=self.liveness)
        try:
            self.httpd.start()
        except OSError as exc:  # strerror is one sentence: "cannot listen for metrics on ...", or the unusable file
            raise StartupError(exc.strerror or str(exc)) from None
        self.metrics_port = self.httpd.port
        try:
            self.peers = peers_from_config(self.node, self.config.job)
        except (OSError, PeerError) as exc:
            raise StartupError(f"cannot start the peer listener ([job] peer_*): {exc}") from None
        try:
            self.rdzv_store = rdzv_store.from_config(self.config.job)
        except OSError as exc:  # the job's CA or certificate cannot be read
            raise StartupError(f"cannot watch the job's etcd rendezvous ([job] rendezvous_etcd_*): {exc}") from None
        self.rdzv_store.start()
        self.nvml.wake = self._wake.set  # an Xid from NVML's event set, like a kernel event: decided on at once
        self.start_nvml()
        watch_acks = getattr(self.endpoint, "watch_acks", None)
        if watch_acks is not None:  # a rank's acknowledgement wakes the loop: a drain never waits for a poll
            watch_acks(self.act_now)
        for src in self.event_sources:
            src.wake = self._wake.set
            try:
                src.start()
            except OSError as exc:  # a source that cannot start is a reading (up 0), never a failed start
                event(log, "event source failed to start", logging.ERROR, source=src.name, error=str(exc))
        self.poll_once()
        summary = self.summary()
        self.notifier.ready(summary)
        event(log, "sentinel started", node=self.node, gpus=len(self.nvml.gpus), metrics_port=self.metrics_port,
              sources=[self.nvml.name] + [s.name for s in self.event_sources])

    def start_nvml(self) -> bool:
        """nvmlInit and enumeration (bounded by the NVML deadline). On failure the daemon goes on
        blind to the GPUs: logged, counted (``sentinel_nvml_init_failures_total``), reported
        down, and retried from the loop with backoff (one poll interval, doubling to 5 min)."""
        try:
            self.nvml.start()
        except NvmlUnavailable as exc:
            self.nvml_init_failures += 1
            first = not self.nvml_problem
            self.nvml_problem = str(exc)
            interval = self.config.daemon.poll_interval_seconds
            self._nvml_retry_delay = min(300.0, max(interval, 2 * self._nvml_retry_delay))
            self._nvml_retry_at = self.clock() + self._nvml_retry_delay
            if first or self._nvml_retry_delay < 300.0 or self.nvml_init_failures % 12 == 0:
                event(log, "NVML unavailable: the GPUs of this node are not watched; retrying", logging.ERROR,
                      error=self.nvml_problem, retry_in_seconds=self._nvml_retry_delay,
                      hint="no NVIDIA driver or a broken one (nvidia-smi says which); on a machine without "
                           "NVIDIA GPUs, `sentinel run --simulate` runs on simulated ones")
            return False
        if self.nvml_problem:
            event(log, "NVML available again", gpus=len(self.nvml.gpus), driver_version=self.nvml.driver_version)
        self.nvml_started = True
        self.nvml_problem = ""
        self._nvml_retry_delay = 0.0
        bus_map = {g.pci_bus_id: g.index for g in self.nvml.gpus if g.pci_bus_id}
        for src in self.event_sources:
            src.set_gpus(bus_map)
        return True

    def metric_families(self) -> list[Family]:
        """The families of the counters and gauges this daemon publishes: its own and those its
        components declare (``FAMILIES``); the collector renders those and no other name."""
        components = [self.executor, *self.event_sources, self.endpoint, self.migrator, self.jobhealth, self.rdzv_store]
        return [ACTIONS, CONFIG_RELOADS, LOOP_ERRORS, NVML_INIT_FAILURES, LAST_POLL,
                *(f for c in components if c is not None for f in getattr(c, "FAMILIES", ()))]

    def stop(self) -> None:
        self._stop.set()
        self._urgent.set()
        self._wake.set()

    def act_now(self) -> None:
        """Wake the loop for a step of a migration: decided on at once (see ``urgent``)."""
        self._urgent.set()
        self._wake.set()

    def close(self) -> None:
        self.notifier.stopping()
        if self.httpd is not None:
            self.httpd.close()
        for src in self.event_sources:
            src.close()
        if self.endpoint is not None:
            self.endpoint.close()
        if self.migrator is not None:
            self.migrator.close()
        self.peers.close()
        self.rdzv_store.close()
        self.nvml.close()

    # -- one iteration ------------------------------------------------------------------------
    def _guard(self, component: str, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """Run one component's step; an exception is logged (first, then every 100th), counted
        per component (``sentinel_loop_errors_total``) and replaced by ``default``. No source,
        policy, action or exporter can stop the loop."""
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - the loop never dies
            self.errors[component] += 1
            if self.errors[component] == 1 or self.errors[component] % 100 == 0:
                log.exception("%s failed (%d time(s)); the loop goes on", component, self.errors[component])
            return default

    def poll_once(self) -> NodeReadings:
        now = self.clock()
        t0 = time.perf_counter()
        sources: dict[str, SourceHealth] = {}
        if not self.nvml_started and now >= self._nvml_retry_at:
            self._guard("nvml_init", self.start_nvml)
        gpus = tuple(self._guard("nvml", self.nvml.poll, default=())) if self.nvml_started else ()
        nvml_seconds = time.perf_counter() - t0
        # NVML sees this node when it answered at least one read this poll: not when every GPU is
        # lost or hung, or every call fails, or NVML did not start (sentinel_source_up{source="nvml"} 0)
        sources[self.nvml.name] = SourceHealth(up=any(g.values or g.nvlink for g in gpus), poll_seconds=nvml_seconds,
                                               detail=self.nvml_problem)
        xids, kernel_events, counters = self.drain_sources(sources)
        xids = self._guard("nvml_events", self.nvml.drain_xid_events, default=[]) + xids
        readings = NodeReadings(
            time=now,
            driver_version=self.nvml.driver_version,
            gpus=gpus,
            xid_events=tuple(xids),
            sources=sources,
            nvml_errors=dict(self.nvml.errors),
            kernel_events=tuple(kernel_events),
        )
        return self.decide_and_act(readings, counters, now)

    def drain_sources(self, sources: dict[str, SourceHealth]) -> tuple[list[XidEvent], list[KernelEvent], dict]:
        xids: list[XidEvent] = []
        kernel_events: list[KernelEvent] = []
        counters: dict = {}
        for src in self.event_sources:
            t1 = time.perf_counter()
            try:
                x, k = src.drain()
                xids.extend(x)
                kernel_events.extend(k)
                elapsed = time.perf_counter() - t1
                for name, h in src.health().items():
                    sources[name] = dataclasses.replace(h, poll_seconds=elapsed)
                counters.update(src.counters())
            except Exception as exc:  # noqa: BLE001 - one source failing is a reading, not a dead loop
                self.errors[f"source:{src.name}"] += 1
                if self.errors[f"source:{src.name}"] == 1:
                    log.exception("source %s failed; reported down", src.name)
                sources[src.name] = SourceHealth(up=False, poll_seconds=time.perf_counter() - t1, detail=str(exc))
        return xids, kernel_events, counters

    def poll_events(self) -> NodeReadings:
        """Woken between polls by a kernel event: decide on the events now, with the last GPU readings."""
        now = self.clock()
        sources = dict(self.view.readings.sources) if self.view.readings else {}
        xids, kernel_events, counters = self.drain_sources(sources)
        xids = self._guard("nvml_events", self.nvml.drain_xid_events, default=[]) + xids
        readings = NodeReadings(time=now, driver_version=self.nvml.driver_version, gpus=self.last_gpus, xid_events=tuple(xids),
                                sources=sources, nvml_errors=dict(self.nvml.errors),
                                kernel_events=tuple(kernel_events), events_only=True)
        return self.decide_and_act(readings, counters, now)

    def decide_and_act(self, readings: NodeReadings, counters: dict, now: float) -> NodeReadings:
        if self.migrator is not None and self._guard("migration", self.migrator.check_returned_to_service, default=False):
            self.policy_state = self.policy.returned_to_service(self.policy_state)
        decided = self._guard("policy", self.policy.decide, self.policy_state, readings, now)
        trips = []
        if decided is not None:
            self.policy_state, trips = decided
        counts = self.policy_state.xid_counts  # Xids as the policy counted them: one de-duplication pass
        readings = dataclasses.replace(readings, gpus=tuple(  # a GPU whose counts agree keeps its reading
            g if g.xid_counts == counts.get(g.index, {}) else dataclasses.replace(g, xid_counts=dict(counts.get(g.index, {})))
            for g in readings.gpus))
        if not readings.events_only:
            self.last_gpus = readings.gpus
        for t in trips:
            self.trips[(t.rule, t.action)] += 1
        self._guard("actions", self.executor.execute, trips)
        acks = self._guard("channel", self.endpoint.poll_acks, default=[]) if self.endpoint is not None else []
        for ack in acks:
            event(log, "trainer acknowledged", id=ack.id, rank=ack.rank, pid=ack.pid, step=ack.step, ok=ack.ok,
                  phase=ack.phase, path=ack.path, blocked_seconds=ack.blocked_seconds, error=ack.error)
        self._job_reports(readings, now)
        if self.migrator is not None:
            self._guard("migration", self.migrator.tick, acks)
        self._guard("publish", self.publish, readings, counters)
        return readings

    def _job_reports(self, readings: NodeReadings, now: float) -> None:
        """The ranks' hang verdicts and straggler scores (read off the channel with the acks)
        become trips, joined with this node's GPU readings."""
        if not readings.events_only:
            self._guard("jobhealth", self.jobhealth.readings, readings.gpus, now)
        take = getattr(self.endpoint, "take_reports", None)
        reports = self._guard("channel", take, default=[]) if take is not None else []
        for rep in reports:  # this node's ranks' verdicts only: a forwarded one is never sent on
            if rep.kind == "hang":
                self._guard("peers", self.peers.forward, rep)
        reports = [*reports, *(self._guard("peers", self.peers.receive, default=[]) or [])]
        if not reports:
            return
        for rep in reports:
            event(log, "job report", report=rep.kind, rank=rep.rank, pid=rep.pid, step=rep.step, **{
                f"detail_{k}": v for k, v in rep.detail.items() if k in (
                    "kind", "culprits", "hosts", "evidence", "relative", "individual", "step_seconds", "steps_left")})
        trips = self._guard("jobhealth", self.jobhealth.observe, reports, now, default=[]) or []
        for t in trips:
            self.trips[(t.rule, t.action)] += 1
        if trips:
            self._guard("actions", self.executor.execute, trips)

    def publish(self, readings: NodeReadings, counters: dict) -> None:
        health = {i: int(s.health) for i, s in self.policy_state.gpus.items()}
        forecasts = {i: s.forecast_seconds for i, s in self.policy_state.gpus.items() if s.forecast_seconds is not None}
        rule_active: dict = {}
        for g in readings.gpus:
            rule_active.update(self.policy.rule_active(g))
        for kind_outcome, n in self.executor.counts.items():
            counters[ACTIONS.key(action=kind_outcome[0], outcome=kind_outcome[1])] = float(n)
        for outcome, n in self.reloads.items():
            counters[CONFIG_RELOADS.key(outcome=outcome)] = float(n)
        for component in (self.endpoint, self.migrator, self.jobhealth):
            if component is not None:
                counters.update(self._guard("metrics", component.metric_counters, default={}))
        for component, n in self.errors.items():
            counters[LOOP_ERRORS.key(component=component)] = float(n)
        if self.nvml_init_failures:  # absent on the nodes where NVML started the first time (most)
            counters[NVML_INIT_FAILURES.key()] = float(self.nvml_init_failures)
        gauges: dict = {}
        if not readings.events_only:
            self.last_poll = self.clock()
            gauges[LAST_POLL.key()] = self.wall()
        elif self.view.gauges.get(LAST_POLL.key()) is not None:
            gauges[LAST_POLL.key()] = self.view.gauges[LAST_POLL.key()]
        if self.migrator is not None:
            gauges.update(self._guard("metrics", self.migrator.gauges, default={}))
        gauges.update(self._guard("metrics", self.jobhealth.gauges, default={}))
        gauges.update(self._guard("metrics", self.rdzv_store.gauges, default={}))
        self.view = View(readings, health, forecasts, dict(self.trips), rule_active, counters, gauges, self.node,
                         detail=self.config.metrics.detail)
        if self.httpd is not None:
            self.httpd.invalidate()  # the next scrape renders this view (once, for every scraper)
        self.write_status(readings, health)

    def write_status(self, readings: NodeReadings, health: dict[int, int]) -> None:
        status = {
            "node": self.node,
            "pid": os.getpid(),
            "time": self.wall(),
            "metrics_port": self.metrics_port,
            "driver_version": readings.driver_version,
            "nvml_error": self.nvml_problem or None,  # NVML did not start: the GPUs are not watched
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "pci_bus_id": g.pci_bus_id,
                    "health": Health(health.get(g.index, 0)).name.lower(),
                    "lost": g.lost,
                    "hung": g.hung,
                    "values": dict(g.values),
                    "errors": dict(g.errors),
                    "xid_counts": {str(k): v for k, v in g.xid_counts.items()},
                    "forecast_seconds": self.policy_state.gpus[g.index].forecast_seconds
                    if g.index in self.policy_state.gpus else None,
                }
                for g in readings.gpus
            ],
            "trips": {f"{r}/{a}": n for (r, a), n in self.trips.items()},
            "cordoned": bool(self.migrator and self.migrator.cordoned),
            "migration": self.migrator.record.__dict__ if self.migrator and self.migrator.record else None,
            "job": self.jobhealth.status(),
            "rendezvous_store": self.rdzv_store.status(),
        }
        try:
            write_json_atomic(self.runtime_dir / "status.json", status, fsync=False)  # tmpfs; rewritten every poll
        except OSError as exc:
            self.errors["status_write"] += 1
            if self.errors["status_write"] == 1 or self.errors["status_write"] % 100 == 0:
                event(log, "cannot write status", logging.ERROR, error=str(exc))

    @property
    def liveness_limit_seconds(self) -> float:
        d = self.config.daemon
        return max(d.liveness_polls * d.poll_interval_seconds, d.poll_interval_seconds + d.nvml_deadline_seconds)

    def liveness(self) -> tuple[bool, bool, str]:
        """(live, ready, one line) for ``/livez`` and ``/readyz``; called on the HTTP threads.
        Live while the last completed poll is at most :attr:`liveness_limit_seconds` old (before
        the first poll: since the daemon was built); ready once a poll completed and while live.
        A loop hung anywhere (a source, an action, the status write) stops completing polls."""
        now = self.clock()
        last = self.last_poll
        age = now - (self.started_at if last is None else last)
        limit = self.liveness_limit_seconds
        live = age <= limit
        if last is None:
            return live, False, f"no poll completed yet ({age:.1f} s since start; limit {limit:g} s)"
        if not live:
            return False, False, f"last completed poll {age:.1f} s ago, over the limit of {limit:g} s: the loop is stuck"
        return True, True, f"ok: last completed poll {age:.1f} s ago (limit {limit:g} s)"

    def summary(self) -> str:
        if not self.nvml_started:
            return f"NVML unavailable, GPUs not watched: {self.nvml_problem}"
        counts = Counter(Health(s.health).name.lower() for s in self.policy_state.gpus.values())
        return ", ".join(f"{n} {h}" for h, n in sorted(counts.items())) or "no GPUs"

    # -- loop ---------------------------------------------------------------------------------
    def run(self, reload: Callable[[], Config | None] | None = None) -> None:
        interval = self.config.daemon.poll_interval_seconds
        next_at = self.clock()
        last_summary = ""
        last_events = -math.inf  # when the last event-driven iteration ended
        while not self._stop.is_set():
            next_at += interval
            if reload is not None:
                new = reload()
                if new is not None:
                    self._guard("reload", self.apply_config, new)
                    interval = self.config.daemon.poll_interval_seconds
            try:
                self.poll_once()  # every component inside is guarded: this completes
                self.iterations += 1
                summary = self.summary()
                if summary != last_summary:
                    self.notifier.status(summary)
                    last_summary = summary
                self.notifier.watchdog()
            except Exception:  # noqa: BLE001 - the watchdog loop never dies; no ping this round
                self.errors["loop"] += 1
                log.exception("poll iteration failed")
            while not self._stop.is_set():
                delay = next_at - self.clock()
                if delay <= 0:
                    if delay < -interval:
                        next_at = self.clock()
                    break
                if self._wake.wait(delay):  # a kernel event, an ack: act now, not at the next poll
                    gather = min(last_events + EVENT_BATCH_SECONDS, next_at) - self.clock()
                    if not self._urgent.is_set() and gather > 0:
                        self._urgent.wait(gather)  # a burst: its events are decided on together (a migration's step ends it)
                    if self._stop.is_set():
                        break
                    self._urgent.clear()
                    self._wake.clear()
                    try:
                        self.poll_events()
                    except Exception:  # noqa: BLE001 - the loop never dies
                        log.exception("event-driven iteration failed")
                    last_events = self.clock()

    def apply_config(self, new: Config) -> None:
        """Reload: policy thresholds and intervals change; listeners and sources stay."""
        self.config = new
        self.policy = Policy(new.policy)
        self.nvml.deadline = new.daemon.nvml_deadline_seconds
        self.jobhealth.handover_seconds = new.job.handover_seconds
        if self.migrator is not None:
            self.migrator.reconfigure(new.actions)
        if self.endpoint is not None:
            self.endpoint.registration = new.actions.agent_registration
        event(log, "config reloaded")
