"""The backend interface without a scheduler: the registry, the file and command backends, the
circuit breaker's arithmetic, and the Migrator's retries around a failing backend."""

from __future__ import annotations

import subprocess
import time

import pytest

from conftest import register_agent
from test_migration import Clock, Inline
from sentinel.backends import NAMES, make_backend
from sentinel.backends.base import (Backend, BackendContext, BackendError, CordonReason, Fleet, Unreachable,
                                    UnknownNode)
from sentinel.backends.breaker import decide
from sentinel.channel import RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.config import BACKENDS, ActionsConfig
from sentinel.migration import Migrator
from sentinel.policy import Trip

REASON = CordonReason("xid", 3, "Xid 79 on GPU 3", "r1")
TRIP = Trip(rule="xid", action="migrate", gpu=3, cause="xid:79", message="Xid 79 on GPU 3", values={"xid": 79})


def ctx(tmp_path, run=subprocess.run):
    (tmp_path / "state").mkdir(exist_ok=True)
    return BackendContext(node="n1", state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", timeout=5.0,
                          wall=time.time, run=run)


def test_every_configurable_backend_is_one_module(tmp_path):
    assert NAMES == BACKENDS == ("command", "file", "kubernetes", "slurm")
    for name in ("file", "command", "slurm"):  # kubernetes needs a kubeconfig: tests/test_kubernetes.py
        b = make_backend(ActionsConfig(backend=name), ctx(tmp_path))
        assert isinstance(b, Backend) and b.name == name


def test_reason_is_one_printable_line_that_starts_with_sentinel():
    r = CordonReason("ecc", 2, 'bad "row"\nremap\x00 ' + "x" * 300).short()
    assert r.startswith("sentinel: ecc gpu2 bad 'row'?remap? ") and len(r) == 120 and r.isprintable()
    assert CordonReason("host_memory", -1, "MCE").short() == "sentinel: host_memory node MCE"


def test_file_backend_cordons_with_the_marker_and_uncordons(tmp_path):
    b = make_backend(ActionsConfig(), ctx(tmp_path))
    assert not b.is_cordoned().cordoned
    b.cordon(REASON)
    state = b.is_cordoned()
    assert state.cordoned and state.by_sentinel and "Xid 79" in state.detail
    assert "cordon cleared" in b.uncordon()
    assert not b.is_cordoned().cordoned and "not cordoned" in b.uncordon()


def test_command_backend_runs_each_command_and_reports_its_failure(tmp_path):
    runs = []

    def run(argv, **kw):
        runs.append(argv)
        rc = 3 if argv[0] == "undrain" else 0
        return subprocess.CompletedProcess(argv, rc, "", "no such node" if rc else "")

    b = make_backend(ActionsConfig(backend="command", cordon_command=("drain", "{node}"), uncordon_command=("undrain", "{node}"),
                                   spare_command=("spare", "{node}")), ctx(tmp_path, run))
    b.cordon(REASON)
    assert runs == [["drain", "n1"]] and b.is_cordoned().cordoned
    assert b.start_spare() == "spare command spare ok"
    with pytest.raises(BackendError, match="uncordon command undrain exited 3: no such node"):
        b.uncordon()


def test_command_timeout_is_unreachable(tmp_path):
    def run(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    b = make_backend(ActionsConfig(backend="command", cordon_command=("drain",)), ctx(tmp_path, run))
    with pytest.raises(Unreachable, match="did not finish within 5 s"):
        b.cordon_scheduler(REASON)


@pytest.mark.parametrize("recent,nodes,allowed", [
    (0, 4, True),   # 1/4
    (1, 4, True),   # 2/4 = 50 %: not more than 50 %
    (2, 4, False),  # 3/4
    (0, 1, False),  # the only node: 100 %
    (4, 10, True),  # 5/10
    (5, 10, False),
])
def test_breaker_threshold_is_more_than_the_fraction(recent, nodes, allowed):
    now = 10_000.0
    fleet = Fleet(nodes, tuple((f"x{i}", now - 10) for i in range(recent)))
    v = decide(fleet, "me", now, max_fraction=0.5, window_seconds=300)
    assert v.allowed is allowed and v.recent == recent and v.nodes == nodes


def test_breaker_counts_only_the_window_and_never_this_node():
    now = 10_000.0
    fleet = Fleet(4, (("old1", now - 301), ("old2", now - 3600), ("me", now - 5), ("x", now - 1)))
    v = decide(fleet, "me", now, max_fraction=0.5, window_seconds=300)
    assert v.allowed and v.recent == 1
    assert decide(None, "me", now, max_fraction=0.5, window_seconds=300).allowed


class FlakyScheduler(Backend):
    """A scheduler that refuses the first ``fail`` cordons as unreachable."""

    name = "flaky"
    has_scheduler = True

    def __init__(self, actions, c, fail: int) -> None:
        super().__init__(actions, c)
        self.fail = fail
        self.cordons = 0

    def cordon_scheduler(self, reason):
        self.cordons += 1
        if self.cordons <= self.fail:
            raise Unreachable("slurmctld did not answer")


def migrator(tmp_path, backend, clock, **actions):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    m = Migrator(ActionsConfig(ack_timeout_seconds=1.0, **actions), ep, state_dir=tmp_path / "state",
                 runtime_dir=tmp_path / "run", node="n1", wall=clock, backend=backend, sleep=lambda s: None,
                 workers=Inline())
    return m, ep


def test_a_cordon_the_scheduler_never_took_is_retried_at_later_polls_with_backoff(tmp_path):
    clock = Clock()
    b = FlakyScheduler(ActionsConfig(), ctx(tmp_path), fail=4)  # 2 attempts per step: fails twice
    m, ep = migrator(tmp_path, b, clock, scheduler_attempts=2, drain=False)
    try:
        m.begin("r1", TRIP)
        clock.t += 2  # no rank acknowledges: the deadline passes
        for _ in range(4):
            m.tick([])
        # the cordon step tried twice, then (drained) the first retry at once tried twice more
        assert m.record.phase == "drained" and m.record.scheduler_cordoned is False and b.cordons == 4
        assert m.gauges()[("sentinel_backend_up", (("backend", "flaky"),))] == 0.0
        m.tick([])
        m.tick([])
        assert b.cordons == 4  # backing off: not before the delay passed
        clock.t += 1.5
        m.tick([])
        assert b.cordons == 5 and m.record.scheduler_cordoned is True
        assert m.gauges()[("sentinel_backend_up", (("backend", "flaky"),))] == 1.0
        clock.t += 600
        m.tick([])
        assert b.cordons == 5  # done: no more calls
        counts = m.metric_counters()
        assert counts[("sentinel_backend_calls", (("backend", "flaky"), ("op", "cordon"), ("outcome", "failed")))] == 2
        assert counts[("sentinel_backend_calls", (("backend", "flaky"), ("op", "cordon"), ("outcome", "ok")))] == 1
    finally:
        ep.close()


def test_unknown_node_is_not_retried(tmp_path):
    class Gone(FlakyScheduler):
        def cordon_scheduler(self, reason):
            self.cordons += 1
            raise UnknownNode("node 'n1' is not known")

    clock = Clock()
    b = Gone(ActionsConfig(), ctx(tmp_path), fail=0)
    m, ep = migrator(tmp_path, b, clock, scheduler_attempts=5, drain=False)
    try:
        m.begin("r1", TRIP)
        clock.t += 2
        for _ in range(3):
            m.tick([])
        # one call in the cordon step and one at the first later retry; never tried again at once
        assert b.cordons == 2
        counts = m.metric_counters()
        assert counts[("sentinel_backend_calls", (("backend", "flaky"), ("op", "cordon"), ("outcome", "failed")))] == 2
        assert ("sentinel_backend_calls", (("backend", "flaky"), ("op", "cordon"), ("outcome", "retried"))) not in counts
        assert m.gauges()[("sentinel_backend_up", (("backend", "flaky"),))] == 1.0  # it answered (with a refusal)
    finally:
        ep.close()


class Crowded(Backend):
    """Two of four nodes already cordoned by Sentinel a minute ago: one more is over half."""

    name = "crowded"
    has_scheduler = True
    has_fleet = True

    def fleet(self, now):
        return Fleet(4, (("a", now - 60), ("b", now - 60)))

    def claim_cordon(self, reason):
        return decide(self.fleet(self.ctx.wall()), self.node, self.ctx.wall(), max_fraction=0.5, window_seconds=300)


def test_a_restart_while_the_breaker_decides_asks_it_again(tmp_path):
    clock = Clock()
    rank = None
    m, ep = migrator(tmp_path, Crowded(ActionsConfig(), ctx(tmp_path)), clock)
    rank = RankEndpoint.open(tmp_path / "run")
    m.workers = _Never()  # the breaker's claim never returns before the "crash"
    m.begin("r1", TRIP)
    assert m.record.phase == "requested"  # the snapshot request left first
    clock.t += 2  # no ack: the deadline passes, the cordon (with its breaker claim) starts and hangs
    m.tick([])
    assert m.record.phase == "acknowledged"
    ep.close()
    m2, ep2 = migrator(tmp_path, Crowded(ActionsConfig(), ctx(tmp_path)), clock)
    try:
        m2.tick([])  # the claim is asked again ...
        m2.tick([])  # ... and its refusal acted on
        assert m2.record.phase == "refused" and m2.record.request_id == "r1"
        assert [(r.type, r.id) for r in rank.poll()] == [("migrate", "r1")]  # one request, before any count
        assert not (tmp_path / "state" / "cordon.json").exists() and not m2.cordoned
        assert m2.metric_counters()[("sentinel_breaker_refusals", (("backend", "crowded"),))] == 1
    finally:
        ep2.close()
        rank.close()


class _Never(Inline):
    def submit(self, fn, *args, **kwargs):
        import concurrent.futures

        return concurrent.futures.Future()


def test_settle_drain_then_recount():
    from sentinel.backends.breaker import settle

    now = 10_000.0
    # 3 of 4 drained in the same second: the order is (time, name); the third loses, the first two wait
    burst = Fleet(4, (("a", now), ("b", now), ("c", now)))
    assert [settle(burst, n, now, max_fraction=0.5, window_seconds=300)[0] for n in "abc"] == ["wait", "wait", "lost"]
    # once the loser resumed, both left win
    after = Fleet(4, (("a", now), ("b", now)))
    assert [settle(after, n, now, max_fraction=0.5, window_seconds=300)[0] for n in "ab"] == ["won", "won"]
    # an older drain in the window ranks first: a newcomer past the slots loses at once
    old = Fleet(4, (("z", now - 100), ("y", now - 50), ("a", now)))
    outcome, verdict = settle(old, "a", now, max_fraction=0.5, window_seconds=300)
    assert outcome == "lost" and not verdict.allowed and "75% > 50%" in verdict.why
    # drains outside the window are not counted; no nodes in scope: the breaker does not apply
    assert settle(Fleet(4, (("z", now - 301), ("y", now - 400), ("a", now))), "a", now, max_fraction=0.5,
                  window_seconds=300)[0] == "won"
    assert settle(Fleet(0, ()), "a", now, max_fraction=0.5, window_seconds=300)[0] == "won"


def test_a_clock_skew_never_opens_the_breaker():
    """The drains' stamps come from another clock (slurmctld's, another node's Lease entry): a
    burst stamped 2 minutes ahead of this node's clock is counted, never left out."""
    from sentinel.backends.breaker import settle

    now = 10_000.0
    burst = Fleet(4, (("a", now + 120), ("b", now + 120), ("c", now + 120)))
    assert [settle(burst, n, now, max_fraction=0.5, window_seconds=300)[0] for n in "abc"] == ["wait", "wait", "lost"]
    ahead = Fleet(4, (("x", now + 120), ("y", now + 3600)))
    v = decide(ahead, "me", now, max_fraction=0.5, window_seconds=300)
    assert not v.allowed and v.recent == 2
