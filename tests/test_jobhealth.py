"""Rank reports -> trips on the daemon: the hang culprit's node hands itself over, a straggler
is handed over only when it pays and says why; reports only from the job's own ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import register_agent
from sentinel.channel import MalformedMessage, RankEndpoint, Report, decode
from sentinel.daemon_endpoint import DaemonEndpoint
from sentinel.jobhealth import JobHealth
from sentinel.readings import GpuReading
from sentinel.straggler import StragglerSettings

import pytest


def hang(hosts, kind="stopped"):
    return Report("hang", 0, 41, {"kind": kind, "culprits": [3], "hosts": hosts, "evidence": "rank 3 did not answer"})


def test_the_culprits_node_trips_hang_with_migrate_and_the_others_only_record_it():
    here = JobHealth("node1")
    (trip,) = here.observe([hang(["node1"])], 10.0)
    assert trip.rule == "hang" and trip.action == "migrate" and "rank(s) [3]" in trip.message
    assert trip.values["culprit_rank"] == 3
    other = JobHealth("node0")
    assert other.observe([hang(["node1"])], 10.0) == []
    assert other.status()["hang"]["hosts"] == ["node1"] and other.status()["hang"]["here"] is False
    assert JobHealth("node1").observe([hang(["node1"], kind="unknown")], 10.0) == []


def gpu(index, **values):
    return GpuReading(index, f"GPU-{index}", f"0000:0{index}:00.0", values=values)


def test_a_straggler_with_a_hardware_slowdown_is_handed_over_when_it_pays_and_says_why():
    jh = JobHealth("node2", handover_seconds=60.0)
    jh.readings([gpu(0, throttle_reasons=0.0, pcie_replay=0.0, pcie_link_width=16.0),
                 gpu(1, throttle_reasons=0.0, pcie_replay=0.0, pcie_link_width=16.0)], 0.0)
    jh.readings([gpu(0, throttle_reasons=0.0, pcie_replay=0.0, pcie_link_width=16.0),
                 gpu(1, throttle_reasons=8.0, pcie_replay=0.0, pcie_link_width=16.0)], 60.0)
    rep = Report("straggler", 2, 120, {"relative": 1.5, "individual": 1.5, "step_seconds": 1.5, "steps_left": 1000})
    (trip,) = jh.observe([rep], 60.0)
    assert trip.rule == "straggler" and trip.action == "migrate" and "GPU 1: hw_slowdown" in trip.message
    assert jh.status()["straggler"]["causes"] == ["GPU 1: hw_slowdown"]
    assert jh.gauges()[("sentinel_job_straggler_cause_info", (("cause", "GPU 1: hw_slowdown"),))] == 1.0
    near_end = Report("straggler", 2, 990, {"relative": 1.5, "individual": 1.5, "step_seconds": 1.5, "steps_left": 10})
    (trip,) = jh.observe([near_end], 61.0)
    assert trip.action == "alert"


def test_a_straggler_without_a_hardware_cause_says_so():
    jh = JobHealth("n", settings=StragglerSettings())
    jh.readings([gpu(0, throttle_reasons=1.0)], 0.0)  # idle bit only
    (trip,) = jh.observe([Report("straggler", 0, 5, {"relative": 1.4, "step_seconds": 1.0})], 1.0)
    assert trip.action == "alert" and "no hardware cause seen" in trip.message  # steps left unknown: alert


def test_report_round_trip_and_malformed_reports():
    r = Report("straggler", 3, 7, {"relative": 1.5})
    assert decode(r.encode()) == r
    for bad in (b'{"version": 1, "type": "report", "kind": "explode", "rank": 1, "step": 1}',
                b'{"version": 1, "type": "report", "kind": "hang", "rank": "1", "step": 1}',
                b'{"version": 1, "type": "report", "kind": "hang", "rank": 1, "step": 1, "detail": []}'):
        with pytest.raises(MalformedMessage):
            decode(bad)
    long = Report("hang", 0, 1, {"evidence": "x" * 10000, "culprits": [1]})
    assert len(long.encode()) < 4096 and decode(long.encode()).detail["culprits"] == [1]


def test_reports_are_accepted_from_the_jobs_ranks_only(tmp_path, attacker, shared_tmp):
    runtime = shared_tmp
    register_agent(runtime)
    daemon = DaemonEndpoint(runtime)
    rank = RankEndpoint.open(runtime)
    try:
        assert rank.report(hang(["node1"]))
        send = ("import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                f"s.sendto({hang(['node1']).encode()!r}, {str(runtime / 'daemon.sock')!r})")
        # another user cannot reach daemon.sock at all (root:<the job's group> 0660)
        forged = attacker.python(send)
        assert forged.returncode != 0 and "PermissionError" in forged.stderr, forged.stderr
        # a process that can reach it but is not one of the job's verified ranks is refused
        other = subprocess.run([sys.executable, "-c", send], capture_output=True, text=True, timeout=30)
        assert other.returncode == 0, other.stderr
        got = []
        deadline = time.monotonic() + 5
        while len(got) + daemon.rejected["report_not_a_rank"] < 2 and time.monotonic() < deadline:
            daemon.poll_acks()
            got += daemon.take_reports()
        assert [(r.kind, r.pid) for r in got] == [("hang", os.getpid())]
        assert daemon.rejected["report_not_a_rank"] == 1
    finally:
        rank.close()
        daemon.close()


def test_status_lines_say_who_hung_and_why_a_node_is_slow():
    from sentinel.jobhealth import status_lines

    jh = JobHealth("node1")
    jh.readings([gpu(0, throttle_reasons=8.0)], 0.0)
    jh.observe([hang(["node1"]), Report("straggler", 2, 50, {"relative": 1.5, "individual": 1.4,
                                                              "step_seconds": 1.5, "steps_left": 2})], 1.0)
    lines = status_lines(jh.status())
    assert lines[0].startswith("hang: stopped at step 41: culprit rank(s) [3] on this node")
    assert "1.50x the job's median compute" in lines[1] and "GPU 0: hw_slowdown" in lines[1] and "-> alert" in lines[1]
    assert status_lines({}) == []


def test_a_store_the_agent_cannot_reach_shows_in_status_and_metrics_and_trips_nothing():
    """#41 store-host: trainer.elastic's last word when the rendezvous store is gone."""
    from sentinel.jobhealth import RENDEZVOUS_STORE_UP, status_lines

    jh = JobHealth("node1")
    lost = Report("rendezvous", 0, -1, {"store": "198.18.0.2:29400", "reachable": False,
                                        "error": "DistNetworkError: Broken pipe"})
    assert decode(lost.encode()) == lost
    assert jh.observe([lost, Report("rendezvous", 0, -1, {"store": 7, "reachable": False})], 1.0) == []
    assert jh.counts["rendezvous_malformed"] == 1 and jh.status()["rendezvous"]["store"] == "198.18.0.2:29400"
    assert jh.gauges()[RENDEZVOUS_STORE_UP.key()] == 0.0
    (line,) = status_lines(jh.status())
    assert line.startswith("rendezvous store 198.18.0.2:29400 cannot be reached (DistNetworkError: Broken pipe)")
    assert RENDEZVOUS_STORE_UP.key() not in JobHealth("node2").gauges()  # left out until an agent reports


def test_the_agent_tells_its_daemon_the_store_is_gone_before_it_exits(shared_tmp):
    """The agent is one of the job's processes: its report is accepted (read while it lingers)."""
    runtime = shared_tmp
    register_agent(runtime)
    daemon = DaemonEndpoint(runtime)
    code = ("import sys; from trainer import store_deadline; store_deadline.REPORT_LINGER_SECONDS = 3.0; "
            "store_deadline.tell_daemon('198.18.0.2:29400', 'DistNetworkError: Broken pipe')")
    agent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "SENTINEL_RUNTIME_DIR": str(runtime)})
    try:
        got = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            daemon.poll_acks()
            got += daemon.take_reports()
            time.sleep(0.05)
        assert [(r.kind, r.pid, r.detail["store"], r.detail["reachable"]) for r in got] == [
            ("rendezvous", agent.pid, "198.18.0.2:29400", False)]
        assert agent.wait(30) == 0
    finally:
        agent.kill()
        daemon.close()


def test_a_slow_link_straggler_says_the_link_and_weighs_the_jobs_slowdown():
    """#41 slow-link: ``relative`` is the job's slowdown since its best window (what the hand-over
    wins back), ``link_relative`` the node's link time over the job's median."""
    from sentinel.jobhealth import status_lines

    jh = JobHealth("node1", handover_seconds=5.0)
    rep = Report("straggler", 2, 41, {"relative": 7.8, "individual": 1.1, "step_seconds": 1.1, "steps_left": 18,
                                      "link_relative": 392.0})
    (trip,) = jh.observe([rep], 1.0)
    assert trip.action == "migrate" and "the job runs 7.80x slower than its best" in trip.message
    assert "network link 392.0x slower than the job's median" in trip.message
    (line,) = status_lines(jh.status())
    assert "the job runs 7.80x slower than its best" in line and "-> migrate" in line
    near_end = Report("straggler", 2, 58, {"relative": 7.8, "step_seconds": 1.1, "steps_left": 1, "link_relative": 392.0})
    (trip,) = jh.observe([near_end], 2.0)
    assert trip.action == "alert" and "less than the hand-over's" in trip.message  # it would not pay


def test_a_rendezvous_report_cannot_write_escape_sequences_to_the_operators_terminal():
    """The report is the job's (its agent's) word; `sentinel status` prints it to root's terminal."""
    from sentinel import jobhealth

    jh = JobHealth("node-a")
    rep = decode(Report("rendezvous", 0, -1, {"store": "h:1\x1b]0;pwned\x07\x1b[2J", "reachable": False,
                                              "error": "x\r\nsentinel: all healthy\x1b[8m"}, pid=4242).encode())
    assert jh.observe([rep], 1.0) == []
    lines = jobhealth.status_lines(jh.status())
    assert lines and not any(c in "".join(lines) for c in "\x1b\x07\r\n"), lines


def test_a_hang_report_cannot_write_escape_sequences_or_unbounded_text():
    """The hang verdict is the job's word too: `sentinel status` and the trip's message print it
    (a datagram is <= 4 kB, so the lists are bounded here by what one message can carry)."""
    from sentinel import jobhealth

    evil = "x\r\nsentinel: all healthy\x1b[8m\x1b]0;pwned\x07"
    rep = decode(Report("hang", 0, 41, {"kind": "stopped", "culprits": list(range(300)) + [True, "3"],
                                        "hosts": ["node1", "n\x1b[31m", 7] + ["h"] * 300,
                                        "evidence": evil * 20}, pid=4242).encode())
    jh = JobHealth("node1")
    (trip,) = jh.observe([rep], 1.0)
    assert trip.action == "migrate" and not any(c in trip.message for c in "\x1b\x07\r\n"), trip.message
    hang = jh.status()["hang"]
    assert len(hang["hosts"]) <= 64 and len(hang["culprits"]) <= 64 and len(hang["evidence"]) <= 4 * 400
    assert all(isinstance(c, int) and not isinstance(c, bool) for c in hang["culprits"])
    (line,) = jobhealth.status_lines(jh.status())
    assert not any(c in line for c in "\x1b\x07\r\n"), line
    # a report whose lists are not lists is counted and survives (no exception, no trip)
    odd = decode(Report("hang", 0, 41, {"kind": "stopped", "culprits": "3", "hosts": "node1"}, pid=1).encode())
    assert JobHealth("node1").observe([odd], 1.0) == []
    jh.observe([decode(Report("hang", 0, 42, {"kind": "stopped\x1b[2J", "hosts": ["node1"]}, pid=1).encode())], 2.0)
    (line,) = jobhealth.status_lines(jh.status())  # a kind that is no verdict: recorded (escaped), no trip
    assert "\x1b" not in line and "stopped" in line, line


def test_numbers_a_rank_reports_out_of_any_real_range_are_refused_not_shown_nor_raised():
    """The channel's JSON takes any integer up to 4,300 digits and NaN/Infinity. A culprit rank past
    a 31-bit rank raised OverflowError in the hang trip (the whole poll's reports were dropped, a
    real verdict from another rank with them) and showed in status; a NaN or huge straggler score
    reached the gauges and a 300-character status line. Such numbers are refused like a malformed report."""
    big = int("1" + "0" * 400)
    real = hang(["node1"])
    jh = JobHealth("node1")
    forged = Report("hang", 1, 41, {"kind": "stopped", "culprits": [big], "hosts": ["node1"], "evidence": "x"})
    trips = jh.observe([forged, real], 1.0)  # raised before: no trip, the real verdict lost with it
    assert [t.rule for t in trips] == ["hang"] and str(big) not in trips[0].message
    assert jh.hang["culprits"] == [3]  # the newest verdict, read after the forged one
    for detail in ({"relative": 1.5, "individual": float("nan"), "step_seconds": 1.0},
                   {"relative": 1e308, "step_seconds": 1.0},
                   {"relative": 1.5, "step_seconds": 1e300},
                   {"relative": 1.5, "step_seconds": 1.0, "steps_left": big}):
        jh = JobHealth("node1")
        assert jh.observe([decode(Report("straggler", 0, 5, detail).encode())], 1.0) == [], detail
        assert jh.gauges() == {} and jh.counts.get("straggler_malformed") == 1, detail
