"""Control channel: format, cost, and that only the daemon (root) can make a rank snapshot."""

from __future__ import annotations

import os
import socket
import time

import pytest

from sentinel import channel
from conftest import register_agent, wait_for
from sentinel.channel import Ack, RankEndpoint, Request, decode
from sentinel.daemon_endpoint import DaemonEndpoint


def test_round_trip_and_ack(tmp_path):
    register_agent(tmp_path)
    daemon = DaemonEndpoint(tmp_path)
    rank = RankEndpoint.open(tmp_path)
    try:
        assert daemon.request("migrate", "m1", "GPU 3: xid 79") == 1
        assert rank.poll() == [Request(type="migrate", id="m1", reason="GPU 3: xid 79")]
        assert rank.ack(Ack(id="m1", rank=5, step=41, ok=True, path="/s/step-41", blocked_seconds=0.01))
        acks = []
        deadline = time.monotonic() + 2
        while not acks and time.monotonic() < deadline:
            acks = daemon.poll_acks()
        assert acks[0].step == 41 and acks[0].pid == os.getpid() and daemon.complete("m1")
    finally:
        rank.close()
        daemon.close()


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[]", b'{"version": 2, "type": "snapshot", "id": "x"}',
                                 b'{"version": 1, "type": "explode", "id": "x"}', b'{"version": 1, "type": "snapshot", "id": 3}',
                                 b'{"version": 1, "type": "ack", "id": "x", "bogus": 1}', b"{" * 5000])
def test_malformed_messages_are_rejected(raw):
    with pytest.raises(channel.MalformedMessage):
        decode(raw)


def test_malformed_message_is_counted_and_ignored(tmp_path):
    register_agent(tmp_path)
    DaemonEndpoint(tmp_path).close()
    rank = RankEndpoint.open(tmp_path)
    try:
        channel.send_raw(rank.path, b"not json at all")
        channel.send_raw(rank.path, Request(type="snapshot", id="ok").encode())
        assert rank.poll() == [Request(type="snapshot", id="ok")]
        assert rank.counts["malformed"] == 1
    finally:
        rank.close()


def test_acks_go_over_the_channel_handed_with_the_request_and_over_daemon_sock_once_it_is_gone(tmp_path):
    """The daemon hands each rank one end of a socket pair with its request; the rank acks there
    (past any flood of daemon.sock). A daemon that restarted since has closed its end: the rank's
    send fails at once and the ack goes over daemon.sock to the new daemon instead."""
    register_agent(tmp_path)
    daemon = DaemonEndpoint(tmp_path)
    rank = RankEndpoint.open(tmp_path)
    try:
        assert daemon.request("snapshot", "s1", "") == 1
        assert [r.id for r in rank.poll()] == ["s1"]
        assert rank.ack(Ack(id="s1", rank=0, step=1, ok=True, phase="staged"))
        assert rank.counts["ack_direct"] == 1
        daemon.close()
        register_agent(tmp_path)
        daemon = DaemonEndpoint(tmp_path)
        daemon.request("snapshot", "s1", "")  # the new daemon asks again: the rank holds a dead end
        rank.sock.connect(str(tmp_path / "daemon.sock"))  # reconnected, as its next poll would
        assert rank.ack(Ack(id="s1", rank=0, step=1, ok=True))
        assert rank.counts["ack_channel_lost"] == 1 and rank.counts["ack_direct"] == 1
        acks = wait_for(daemon.poll_acks, 5, what="the ack over daemon.sock")
        assert [a.phase for a in acks] == ["committed"] and daemon.complete("s1")
    finally:
        rank.close()
        daemon.close()


def test_a_descriptor_from_a_sender_that_is_not_the_daemon_is_closed_not_used(tmp_path):
    """Only a daemon uid may hand a rank its ack channel: anyone else's descriptor is closed at once
    (its sender sees the end it kept refused) and the rank goes on acking over daemon.sock."""
    import array

    (tmp_path / "ranks").mkdir()  # no daemon yet: the rank's socket is not connected, anyone may send
    rank = RankEndpoint(tmp_path, allowed_uids=frozenset({os.geteuid() + 1}))  # this test's uid is not the daemon's
    forger, passed = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendmsg([Request(type="migrate", id="m", reason="").encode()],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [passed.fileno()]).tobytes())], 0,
                      str(rank.path))
        passed.close()
        assert rank.poll() == []
        assert rank.counts["refused_sender"] == 1 and rank.counts["refused_descriptor"] == 1
        with pytest.raises(ConnectionRefusedError):  # the rank closed the end it was passed
            forger.send(b"x")
    finally:
        forger.close()
        rank.close()


def test_a_descriptor_that_is_no_datagram_socket_is_closed_and_the_request_still_counts(tmp_path):
    import array

    (tmp_path / "ranks").mkdir()
    rank = RankEndpoint(tmp_path, allowed_uids=frozenset({os.geteuid()}))  # the sender is "the daemon" here
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendmsg([Request(type="snapshot", id="p", reason="").encode()],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w]).tobytes())], 0, str(rank.path))
        os.close(w)
        assert rank.poll() == [Request(type="snapshot", id="p")]
        assert rank.counts["refused_descriptor"] == 1 and rank.counts["ack_channel"] == 0
        assert os.read(r, 1) == b""  # the rank closed the pipe's write end it was passed: no writer is left
    finally:
        os.close(r)
        rank.close()


def test_idle_poll_never_blocks_and_reconnects_only_on_schedule(tmp_path):
    """guard.step() polls every step: an idle poll must return at once with nothing and must
    not reconnect (a syscall per step) before ``reconnect_seconds`` have passed. Its cost in
    microseconds is measured by bench/, not asserted here."""
    register_agent(tmp_path)
    DaemonEndpoint(tmp_path).close()
    now = [100.0]
    rank = RankEndpoint(tmp_path, reconnect_seconds=0.5, clock=lambda: now[0])
    try:
        assert rank.sock.gettimeout() == 0.0  # non-blocking: a poll can never wait for the daemon
        connects = []
        real = rank._connect
        rank._connect = lambda: (connects.append(now[0]), real())[1]
        for _ in range(2000):
            assert rank.poll() == []
        assert connects == []  # the clock did not move: no reconnect
        now[0] += 0.5
        for _ in range(2000):
            assert rank.poll() == []
        assert connects == [100.5]  # exactly one reconnect per interval
    finally:
        rank.close()


def test_an_idle_second_of_polling_costs_almost_no_cpu(tmp_path):
    """No busy loop: a rank that polls at every step of an idle second (1 ms steps, nothing
    asked) spends a small fraction of that second on the CPU. Measured as this thread's own CPU
    time, which other processes' load does not inflate (a poll that spun or retried while
    waiting for the daemon would cost its whole wait here, however loaded the host)."""
    register_agent(tmp_path)
    daemon = DaemonEndpoint(tmp_path)
    rank = RankEndpoint.open(tmp_path)
    try:
        polls = 0
        cpu0, end = time.thread_time(), time.monotonic() + 1.0
        while time.monotonic() < end or polls < 500:  # at least 500 polls, however slow the host
            assert rank.poll() == []
            polls += 1
            time.sleep(0.001)  # the step's own work: not this thread's CPU
        cpu = time.thread_time() - cpu0
        assert cpu < 0.25, f"{polls} idle polls cost {cpu:.3f} CPU-s"
    finally:
        rank.close()
        daemon.close()


def test_daemon_restart_keeps_ranks_reachable(tmp_path):
    register_agent(tmp_path)
    d1 = DaemonEndpoint(tmp_path)
    rank = RankEndpoint.open(tmp_path)
    d1.close()
    register_agent(tmp_path)
    d2 = DaemonEndpoint(tmp_path)  # a restarted daemon finds the rank's socket
    try:
        assert d2.request("snapshot", "after-restart", "") == 1
        # the rank is still connected to the old daemon's socket (the kernel refuses the new one's
        # datagram: EPERM) until its next poll reconnects; the daemon retries meanwhile
        got = []

        def arrived():
            d2.poll_acks()  # retries the pending send
            got.extend(rank.poll())
            return got

        assert [r.id for r in wait_for(arrived, 5, what="the request after the restart")] == ["after-restart"]
    finally:
        rank.close()
        d2.close()


@pytest.mark.needs_root
def test_forged_request_from_a_non_root_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the sender under another uid")
    import shutil
    import tempfile
    from pathlib import Path

    runtime = Path(tempfile.mkdtemp(prefix="sentinel-run-", dir="/tmp"))  # pytest's tmp is 0700: nobody can't reach it
    runtime.chmod(0o755)  # as systemd's RuntimeDirectory= makes /run/sentinel
    register_agent(runtime)
    daemon = DaemonEndpoint(runtime)
    rank = RankEndpoint.open(runtime)
    try:
        forged = Request(type="migrate", id="evil", reason="forged").encode()
        pid = os.fork()
        if pid == 0:  # child: become nobody, then send a perfectly well-formed request
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    try:
                        s.sendto(forged, str(rank.path))
                    except PermissionError:
                        code = 0  # the rank's socket is 0600: nobody else may even send
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged sender could send to the rank"
        assert rank.poll() == []
        daemon.request("snapshot", "real", "from root")
        assert [r.id for r in rank.poll()] == ["real"]
    finally:
        rank.close()
        daemon.close()
        shutil.rmtree(runtime, ignore_errors=True)
