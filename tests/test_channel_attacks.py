"""Attacks on the control channel by another local user and by the job's own user (issue #24,
points 1-4 and 7). The rule each one is held to: the migration's snapshot request reaches the
node's verified ranks, and nothing a user sends turns the migration into a drain without one.

The job here runs as ``nobody`` (its rank is also its agent); the other user is the throwaway
``attacker``. Every flood and plant runs as that user for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, SYSTEM_PYTHON, register_agent, wait_for
from sentinel import channel
from sentinel.channel import Ack, RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint
from test_migration import TRIP, Clock, advance, make

pytestmark = pytest.mark.needs_root

JOB_UID = JOB_GID = 65534  # nobody: the job's user

# A training rank of the job: opens its endpoint, says where it is, waits for "go", then answers
# every request with a staged and a committed ack (recording the ids, what ack() returned, its
# counts, and the time.time() before the staged ack, after it and after the committed one).
RANK = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from sentinel.channel import Ack, RankEndpoint
    out = Path(sys.argv[2])
    ep = RankEndpoint.open(Path(sys.argv[1]))
    print(os.getpid(), ep.path, flush=True)
    sys.stdin.readline()
    end = time.time() + 60
    while time.time() < end:
        for r in ep.poll():
            t0 = time.time()
            staged = ep.ack(Ack(id=r.id, rank=0, step=5, ok=True, phase="staged", bytes=1000))
            t1 = time.time()
            committed = ep.ack(Ack(id=r.id, rank=0, step=5, ok=True))
            t2 = time.time()
            with open(out / "got", "a") as f:
                f.write(json.dumps([r.type, r.id, staged, committed, dict(ep.counts), [t0, t1, t2]]) + "\\n")
        time.sleep(0.01)
""")

# Send datagrams to a path as fast as possible; print the outcome counts. "fill": stop at the
# first EAGAIN (the queue is full and stays full until its reader reads).
FLOOD = textwrap.dedent("""
    import errno, json, socket, sys, time
    path, how, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    data = b'{"version":1,"type":"ack","id":"m1","rank":0,"step":1,"ok":true}'
    counts = {}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    end = time.time() + seconds
    while time.time() < end:
        try:
            s.sendto(data, path)
            key = "sent"
        except OSError as exc:
            key = errno.errorcode[exc.errno]
        counts[key] = counts.get(key, 0) + 1
        if how == "fill" and key == "EAGAIN":
            break
    print(json.dumps(counts), flush=True)
""")


class JobRank:
    def __init__(self, runtime: Path, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", RANK, str(runtime), str(out)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, user=JOB_UID, group=JOB_GID, extra_groups=[],
                                     env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        pid, path = self.proc.stdout.readline().split()
        self.pid, self.path = int(pid), Path(path)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def answers(self) -> list:
        try:
            return [json.loads(line) for line in (self.out / "got").read_text().splitlines()]
        except FileNotFoundError:
            return []

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def flood(path: Path, how: str, seconds: float, *, attacker=None) -> subprocess.Popen:
    argv = [SYSTEM_PYTHON, "-c", FLOOD, str(path), how, str(seconds)]
    if attacker is not None:
        return attacker.popen(argv, stdout=subprocess.PIPE, text=True)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, user=JOB_UID, group=JOB_GID, extra_groups=[],
                            env={"PATH": "/usr/bin:/bin"})


def outcome(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=60)
    return json.loads(out)


@pytest.fixture
def job(shared_tmp):
    runtime = shared_tmp / "run"
    runtime.mkdir(mode=0o755)
    out = shared_tmp / "out"
    out.mkdir()
    os.chown(out, JOB_UID, JOB_GID)
    ep = DaemonEndpoint(runtime)  # before the job registers: daemon.sock is root's alone
    rank = JobRank(runtime, out)
    yield runtime, ep, rank
    rank.stop()
    ep.close()


def drive(m, ep, until, seconds=20.0, what="the migration"):
    """The daemon's loop: poll the acks (which retries pending sends) and tick, until ``until()``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        advance(m, ep.poll_acks())
        if until():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: phase {m.record.phase}, notes {m.record.notes}")


def acl(path: Path) -> dict:
    import struct

    raw = os.getxattr(path, "system.posix_acl_access", follow_symlinks=False)
    tags = {0x01: "user_obj", 0x02: "user", 0x04: "group_obj", 0x08: "group", 0x10: "mask", 0x20: "other"}
    out = {}
    for off in range(4, len(raw), 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, off)
        out[(tags[tag], ident if tag in (0x02, 0x08) else None)] = perm
    return out


DAEMON = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from sentinel.daemon_endpoint import DaemonEndpoint
    ep = DaemonEndpoint(Path(sys.argv[1]))
    asked = ep.request("migrate", "m1", "test", retry_seconds=30)
    print("asked", asked, flush=True)
    end = time.monotonic() + 30
    while not ep.complete("m1") and time.monotonic() < end:
        ep.poll_acks()
        time.sleep(0.02)
    print(json.dumps({"complete": ep.complete("m1"), "counts": {"/".join(k): v for k, v in ep.counts.items()}}))
    ep.close()
""")


# -- 1. flooding a rank's socket ----------------------------------------------------------------------
def test_a_flood_of_the_rank_socket_never_keeps_the_snapshot_request_out(attacker, job, tmp_path):
    """Before the job registered, the rank's socket is not yet connected to the daemon: only the
    job's user may write to it (0600), and fills its queue. The migrate request then meets a
    full queue (EAGAIN): the rank still counts as asked, and the request is retried until it is
    in. Once connected, the kernel refuses every other sender, the job's user included."""
    runtime, ep, rank = job
    assert rank.path.stat().st_mode & 0o007 == 0  # nothing for other users (0600 plus the daemon's ACL entry)
    assert outcome(flood(rank.path, "fill", 10))["EAGAIN"] == 1  # the job's user filled the queue
    assert set(outcome(flood(rank.path, "fill", 1, attacker=attacker))) == {"EACCES"}  # another user: not even that
    register_agent(runtime, rank.pid)
    clock = Clock()
    m = make(tmp_path, ep, clock=clock, ack_timeout_seconds=60.0)
    m.begin("m1", TRIP)
    assert m.record.phase == "requested" and m.record.ranks == 1
    assert ep.counts[("migrate", "retried")] >= 1 and ep.counts[("migrate", "sent")] == 0
    # both users flood on, for the whole migration
    floods = [flood(rank.path, "flood", 3), flood(rank.path, "flood", 3, attacker=attacker)]
    rank.go()
    drive(m, ep, lambda: m.record.phase == "drained")
    assert m.record.snapshot_step == 5 and m.record.snapshot_ok is True
    assert not any("no trainer rank" in n or "acknowledged within" in n for n in m.record.notes)
    assert [a[:2] for a in rank.answers()] == [["migrate", "m1"]]
    job_user, other = (outcome(p) for p in floods)
    assert set(other) == {"EACCES"}  # never one datagram
    assert "EPERM" in job_user  # connected to the daemon: the kernel refuses the job's user too


def test_a_rank_socket_is_reachable_only_by_the_job_user_and_root(attacker, job):
    runtime, ep, rank = job
    st = rank.path.stat()
    assert st.st_uid == JOB_UID and st.st_mode & 0o007 == 0
    assert acl(rank.path) == {("user_obj", None): 6, ("user", 0): 2, ("group_obj", None): 0, ("mask", None): 2,
                              ("other", None): 0}  # the owner, and root may send; nobody else
    register_agent(runtime, rank.pid)
    ep.ranks()  # the daemon takes the job: daemon.sock opens to its group
    st = (runtime / "daemon.sock").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, JOB_GID, 0o660)
    r = attacker.run([SYSTEM_PYTHON, "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                      "s.sendto(b'x', sys.argv[1])", str(runtime / "daemon.sock")])
    assert r.returncode != 0 and "PermissionError" in r.stderr


# -- 2. files planted after registration --------------------------------------------------------------
def test_4200_files_planted_after_registration_neither_hide_the_rank_nor_stay(attacker, shared_tmp, tmp_path):
    runtime = shared_tmp / "run"
    runtime.mkdir(mode=0o755)
    ep = DaemonEndpoint(runtime)  # max_ranks 1024: 4,096 entries read per scan
    register_agent(runtime)
    rank = RankEndpoint.open(runtime)  # the genuine rank (this process is the agent), registered first
    secret = shared_tmp / "precious"
    secret.write_text("root's")
    try:
        plant = (f"cd {runtime / 'ranks'} && for i in $(seq 5000001 5004200); do : > $i.sock; done; "
                 f"ln -s {secret} 9999001.sock; ln -s {secret} junk; mkdir 9999002.sock; mkdir full; : > full/x; "
                 "mkfifo 9999003.sock")
        r = attacker.run(["sh", "-c", plant])
        assert r.returncode == 0, r.stderr
        assert len(os.listdir(runtime / "ranks")) > ep.max_entries
        assert set(ep.ranks()) == {os.getpid()}  # found at once, by name
        m = make(tmp_path, ep, clock=Clock())
        m.begin("m1", TRIP)
        assert [q.id for q in rank.poll()] == ["m1"]  # the snapshot request reached it
        for _ in range(8):  # each scan removes up to max_ranks (1,024) of the junk it read
            ep.ranks()
        left = sorted(os.listdir(runtime / "ranks"))
        assert left == sorted([rank.path.name, "full"])  # a directory with contents is left, counted
        assert secret.read_text() == "root's"  # links were removed, never followed
        assert ep.counts[("rank", "junk_removed")] >= 4200 and ep.counts[("rank", "junk_kept")] >= 1
        assert ep.rejected["not_socket"] >= 4200
    finally:
        rank.close()
        ep.close()


# -- 3. flooding daemon.sock ----------------------------------------------------------------------------
def flood_as_a_job_group_member(path: Path, seconds: float, attacker) -> subprocess.Popen:
    """Another local user who shares the job's group (daemon.sock is root:<job gid> 0660)."""
    return subprocess.Popen(["setpriv", f"--reuid={attacker.uid}", f"--regid={attacker.gid}", f"--groups={JOB_GID}",
                             SYSTEM_PYTHON, "-c", FLOOD, str(path), "flood", str(seconds)],
                            stdout=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin"})


def test_acks_reach_the_daemon_at_once_while_daemon_sock_is_flooded(attacker, job):
    """#47 item 1: the job's user and another user of the job's group keep daemon.sock's queue
    full for the whole request, and the daemon reads nothing until the rank has answered (its
    next poll may be a second away). The rank's two acks go out on its own ack channel (a socket
    pair whose end came with the request: nobody else can reach it, and the kernel lets the rank
    past any queue limit): each ack() returns True within 100 ms without waiting for room, and
    the daemon's next read has both."""
    runtime, ep, rank = job
    register_agent(runtime, rank.pid)
    ep.ranks()
    assert outcome(flood(runtime / "daemon.sock", "fill", 10))["EAGAIN"] == 1  # full before the request
    floods = [flood(runtime / "daemon.sock", "flood", 4), flood_as_a_job_group_member(runtime / "daemon.sock", 4, attacker)]
    assert ep.request("migrate", "m1", "test") == 1
    rank.go()
    (answer,) = wait_for(rank.answers, 30, what="the rank's answer")
    assert answer[:4] == ["migrate", "m1", True, True]
    counts, (t0, t1, t2) = answer[4], answer[5]
    assert counts.get("ack_direct") == 2 and "ack_retried" not in counts  # each ack: one send, taken at once
    assert t1 - t0 < 0.1 and t2 - t1 < 0.1, (t1 - t0, t2 - t1)  # the training step was not held up
    assert sorted(a.phase for a in ep.poll_acks()) == ["committed", "staged"] and ep.complete("m1")
    # both flooders could reach daemon.sock and found its queue full (EAGAIN, not EACCES)
    flooded = [outcome(p) for p in floods]
    assert all(set(f) <= {"sent", "EAGAIN"} and f.get("EAGAIN", 0) > 0 for f in flooded), flooded


def test_acks_are_retried_while_the_job_user_floods_daemon_sock(job, tmp_path):
    """With no ack channel of its own (a daemon older than the channels, or one that restarted
    since the request: the end it handed over is dead), the rank acks over daemon.sock. The job's user fills that queue; the rank's acks
    meet EAGAIN and are retried, so the migration completes on the acks, not on the deadline (the
    clock never moves here)."""
    runtime, ep, rank = job
    register_agent(runtime, rank.pid)
    ep.ranks()
    m = make(tmp_path, ep, clock=Clock(), ack_timeout_seconds=60.0)
    m.begin("m1", TRIP)
    ep.ack_channels.close()  # the rank's end, still in its queue with the request, leads nowhere now
    assert outcome(flood(runtime / "daemon.sock", "fill", 10))["EAGAIN"] == 1
    rank.go()

    def waiting_for_room():  # the rank is in ack(), waiting in poll(2) for room in the daemon's queue
        return Path(f"/proc/{rank.pid}/syscall").read_text().split()[0] in ("7", "271")  # x86-64 poll, ppoll

    wait_for(waiting_for_room, 15, interval=0.02, what="the rank's ack to meet the full queue")
    drive(m, ep, lambda: m.record.phase == "drained")  # the daemon's loop drains its queue: the ack gets in
    (answer,) = rank.answers()
    assert answer[:4] == ["migrate", "m1", True, True]
    assert answer[4].get("ack_retried", 0) >= 1 and "ack_failed" not in answer[4]
    assert m.record.snapshot_step == 5 and not any("acknowledged within" in n for n in m.record.notes)
    assert ep.rejected["ack_not_expected"] >= 10  # the flood itself: refused, counted


# -- 4. a deeply nested datagram -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [b"[" * 4000, b'{"a":' * 800 + b"1" + b"}" * 800, b"[" * 60 + b"]" * 60,
                                 b'{"version":1,"type":"ack","id":"r1","rank":0,"step":4,"ok":true,"path":' + b"[" * 900 + b"]" * 900 + b"}"])
def test_a_nested_datagram_is_malformed_and_the_rest_of_the_batch_is_kept(tmp_path, bad):
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep, clock=Clock())
        m.begin("r1", TRIP)
        rank.ack(Ack(id="r1", rank=0, step=4, ok=True, phase="staged", bytes=10))
        rank.sock.sendto(bad, str(tmp_path / "run" / "daemon.sock"))
        rank.ack(Ack(id="r1", rank=0, step=4, ok=True))
        acks = ep.poll_acks()  # one batch: all three are waiting
        assert [a.phase for a in acks] == ["staged", "committed"]
        assert ep.counts[("ack", "malformed")] == 1
        advance(m, acks)
        assert m.record.phase == "drained" and m.record.snapshot_step == 4
    finally:
        rank.close()
        ep.close()


# -- 7. out-of-range numbers in acks -----------------------------------------------------------------------
def raw_ack(phase: str, number: str) -> bytes:
    return (f'{{"version":1,"type":"ack","id":"r1","rank":0,"step":4,"ok":true,"phase":"{phase}",'
            f'"bytes":{number}}}').encode()


@pytest.mark.parametrize("number", ["1" + "0" * 400, "1000000000000000000", "1e18", "-1", "true", "1.5"])
def test_an_oversized_byte_count_is_malformed_and_the_deadline_holds(tmp_path, number):
    clock = Clock()
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep, clock=clock, ack_timeout_seconds=10.0, snapshot_min_bytes_per_second=50e6)
        m.begin("r1", TRIP)
        rank.sock.sendto(raw_ack("staged", number), str(tmp_path / "run" / "daemon.sock"))
        rank.sock.sendto(raw_ack("committed", number), str(tmp_path / "run" / "daemon.sock"))
        for _ in range(3):
            advance(m, ep.poll_acks())  # no OverflowError, tick after tick
        assert ep.counts[("ack", "malformed")] == 2 and m.record.phase == "requested"
        clock.t += 11  # the plain ack timeout: nothing stretched it
        advance(m)
        assert m.record.phase == "drained" and m.record.staged_bytes == 0
        assert any("0/1 ranks acknowledged" in n for n in m.record.notes)
    finally:
        rank.close()
        ep.close()


def test_the_largest_valid_byte_counts_cannot_hold_a_node_past_the_extension_cap(tmp_path):
    from sentinel.migration import MAX_EXTENSION_SECONDS

    clock = Clock()
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep, clock=clock, ack_timeout_seconds=10.0, snapshot_min_bytes_per_second=1.0)
        m.begin("r1", TRIP)
        rank.ack(Ack(id="r1", rank=0, step=4, ok=True, phase="staged", bytes=channel.MAX_ACK_BYTES))
        advance(m, wait_for(ep.poll_acks, 5, what="the staged ack"))
        clock.t += 10 + MAX_EXTENSION_SECONDS + 1
        advance(m)
        assert m.record.phase == "drained"
    finally:
        rank.close()
        ep.close()


def test_the_daemon_without_cap_dac_override_still_reaches_a_rank_of_another_user(job):
    """The daemon's unit keeps no CAP_DAC_OVERRIDE: to it, a 0600 socket of the job's user is as
    closed as to anyone. The rank's ACL entry for root is what lets the request in."""
    runtime, ep, rank = job
    register_agent(runtime, rank.pid)
    ep.close()
    daemon = subprocess.Popen(["setpriv", "--bounding-set=-dac_override", SYSTEM_PYTHON, "-c", DAEMON, str(runtime)],
                              stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert daemon.stdout.readline().split() == ["asked", "1"]
        rank.go()
        result = json.loads(daemon.stdout.readline())
        assert result["complete"], result
        assert [a[:4] for a in rank.answers()] == [["migrate", "m1", True, True]]
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
