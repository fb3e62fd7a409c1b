"""Trust at the kernel-event edge (issue 11): a kernel line that echoes user text is no Xid report,
/dev/kmsg loss is counted in records, a SIGBUS migrates only when the kernel reports a memory
failure, and files planted in the ranks directory cannot blind the rank-signal probe."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SYSTEM_PYTHON, metric_value, require_ebpf, wait_for

# The kernel's own warning (fs/exec.c) with a file name a user chose; GPU 0 of the simulated node
# is PCI:0000:18:00.
SPOOF = ("process 'sh' launched '/tmp/NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.' "
         "with NULL argv: empty string added")
XID13_GPU1 = "NVRM: Xid (PCI:0000:2a:00): 13, pid=77, name=train, Graphics Exception: marker"


# -- (5) kernel-log spoofing --------------------------------------------------------------------
@pytest.mark.needs_root
@pytest.mark.needs_ebpf
@pytest.mark.parametrize("path", ["ebpf", "kmsg_fallback"])
def test_spoofed_xid_in_a_real_kernel_message_is_not_counted_and_trips_nothing(path, kmsg_writer, sim_state,
                                                                               start_daemon):
    if path == "ebpf":
        require_ebpf("signal:signal_generate", "printk:console")
    d = start_daemon("--simulate", str(sim_state), *(["--no-ebpf"] if path == "kmsg_fallback" else []),
                     ebpf=path == "ebpf")
    source = "ebpf_xid" if path == "ebpf" else "kmsg"
    assert metric_value(d.scrape(), "sentinel_source_up", source="xid", via="ebpf" if path == "ebpf" else "kmsg") == 1
    kmsg_writer(SPOOF)
    kmsg_writer("[ 12.345678] " + SPOOF.split("'")[3][len("/tmp/"):])  # a timestamp is no prefix inside a message
    kmsg_writer(XID13_GPU1)  # a real report after them: once it is counted, the spoofs were handled

    def marker_counted():
        t = d.scrape()
        return t if metric_value(t, "sentinel_gpu_xid_errors_total", gpu="1", xid="13") == 1 else None

    text = wait_for(marker_counted, timeout=15, what="the marker Xid 13 counted")
    assert metric_value(text, "sentinel_gpu_xid_errors_total", gpu="0", xid="79") is None
    assert metric_value(text, "sentinel_kernel_events_total", source=source, kind="xid") == 1
    assert metric_value(text, "sentinel_policy_trips_total", rule="xid", action="migrate") is None
    assert metric_value(text, "sentinel_gpu_health", gpu="0") == 0
    if path == "kmsg_fallback":  # the whole record reaches user space, is seen, and is refused
        assert metric_value(text, "sentinel_kernel_events_total", source="kmsg", kind="xid_not_at_start") == 2
    assert '"action":"migrate"' not in d.log()


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_the_printk_probe_compares_the_start_of_the_message_text(kmsg_writer):
    """printk:console hands the probe the message text itself (no timestamp, no level prefix), so the
    in-kernel comparison at offset 0 drops the spoof while a real report, even one written with a
    level prefix, passes."""
    require_ebpf("signal:signal_generate", "printk:console")
    from sentinel.sources.xid import XidSource

    src = XidSource(use_ebpf=True, kmsg_fallback=False)
    src.set_gpus({"0000:18:00.0": 0, "0000:2a:00.0": 1})
    src.start()
    try:
        assert src.path == "ebpf:printk:console"
        seen = src.probe.table("seen")
        before = sum(v.value for v in seen.values())
        marker = XID13_GPU1.replace("marker", f"marker {os.getpid()}")
        kmsg_writer(SPOOF)
        kmsg_writer("<4>" + marker)
        xids: list = []

        def marker_seen():
            xids.extend(src.drain()[0])
            return any(x.message.endswith(f"marker {os.getpid()}") for x in xids)

        wait_for(marker_seen, timeout=10, what="the marker Xid")
        assert [(x.gpu, x.xid) for x in xids if x.pid == 77] == [(1, 13)]
        assert not [x for x in xids if x.xid == 79]
        assert sum(v.value for v in seen.values()) - before >= 2  # the spoof reached the probe, and was dropped
        assert ("sentinel_kernel_events", (("source", "ebpf_xid"), ("kind", "xid_not_at_start"))) not in src.counters()
    finally:
        src.close()


# -- (16) kmsg loss in records --------------------------------------------------------------------
class FakeKmsg:
    """A FIFO that carries kmsg records, and a read() that can answer EPIPE the way /dev/kmsg does
    when the ring overwrote records the reader had not read."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer always exists: reads say EAGAIN
        self.overrun = threading.Event()

    def record(self, seq: int, text: str, dictionary: str = "") -> None:
        os.write(self.fd, f"6,{seq},{seq * 1000},-;{text}\n{dictionary}".encode())

    def read(self, fd: int, n: int) -> bytes:
        if self.overrun.is_set():
            self.overrun.clear()
            raise OSError(errno.EPIPE, os.strerror(errno.EPIPE))
        return os.read(fd, n)

    def close(self) -> None:
        os.close(self.fd)


def test_kmsg_loss_is_the_exact_number_of_records_skipped_in_sequence(tmp_path):
    from sentinel.sources.xid import XidSource

    dev = FakeKmsg(tmp_path / "kmsg")
    dev.record(100, "old record, in the buffer before the daemon started")
    dev.record(101, XID13_GPU1.replace("marker", "old"))
    src = XidSource(use_ebpf=False, kmsg_path=str(dev.path), kmsg_read=dev.read)
    src.set_gpus({"0000:2a:00.0": 1})
    src.start()
    try:
        assert src.up["kmsg"]

        def lost():
            return src.counters()[("sentinel_kmsg_records_lost", ())]

        def xids_until(n: int) -> list:
            got: list = []
            wait_for(lambda: got.extend(src.drain()[0]) or len(got) >= n, timeout=10, what=f"{n} Xid(s)")
            return got

        dev.record(102, XID13_GPU1.replace("marker", "first"), " SUBSYSTEM=pci\n DEVICE=+pci:0000:2a:00.0\n")
        assert [x.message for x in xids_until(1)] == ["Graphics Exception: first"]  # the old ones were skipped
        assert lost() == 0

        dev.overrun.set()  # the ring overwrote 103..109: EPIPE, then the next record is 110
        dev.record(110, XID13_GPU1.replace("marker", "after overrun"))
        assert [x.message for x in xids_until(1)] == ["Graphics Exception: after overrun"]
        assert lost() == 7

        dev.record(111, "usb 1-1: no gap")
        dev.record(115, XID13_GPU1.replace("marker", "after a gap"))  # a gap without EPIPE counts too
        assert [x.message for x in xids_until(1)] == ["Graphics Exception: after a gap"]
        assert lost() == 10
    finally:
        src.close()
        dev.close()


@pytest.mark.needs_root
def test_real_kmsg_overflow_is_counted_record_for_record(kmsg_writer):
    """Stall the reader, overflow the real ring, let it go: every record after start is either
    handed on or counted lost, and the count is exact."""
    from sentinel.sources.kmsg import KmsgReader

    stalled, resume = threading.Event(), threading.Event()

    def read(fd: int, n: int) -> bytes:
        if stalled.is_set():
            resume.wait(30)
            stalled.clear()
        return os.read(fd, n)

    lines: list[str] = []
    reader = KmsgReader(lines.append, read=read, poll_ms=20)
    reader.start()
    try:
        baseline = reader.last_seq
        assert baseline is not None
        kmsg_writer("sentinel test: before the stall")
        wait_for(lambda: "sentinel test: before the stall" in lines, timeout=10, what="the first record")
        stalled.set()
        kmsg_writer("sentinel test: the reader stalls on this one")
        time.sleep(0.2)  # the reader thread parks in its next read()
        for i in range(6000):  # 6,000 records of ~100 bytes overflow a 128 KiB ring several times over
            kmsg_writer(f"sentinel test: overflow filler record {i:05d} " + "x" * 60)
        kmsg_writer("sentinel test: last")
        resume.set()
        wait_for(lambda: "sentinel test: last" in lines, timeout=20, what="the last record")
        reader.close()  # nothing more is read while we compare
        assert reader.overruns >= 1
        assert reader.lost > 0
        assert len(lines) + reader.lost == reader.last_seq - baseline
    finally:
        resume.set()
        reader.close()


# -- (2) SIGBUS: migrate only on a memory failure the kernel reports ------------------------------
def node_readings(*events):
    from sentinel.readings import NodeReadings

    return NodeReadings(time=0, driver_version="t", gpus=(), kernel_events=tuple(events))


def rank_signal(code, signal_name="SIGBUS", origin=None):
    from sentinel.readings import KernelEvent

    detail = {"pid": 4242, "signal": signal_name, "code": code, "sender_pid": 0, "comm": "python3"}
    if origin is not None:
        detail["memory_failure"] = origin
    return KernelEvent(kind="rank_signal", source="ebpf_rank_signals", detail=detail)


@pytest.mark.parametrize("code,origin,action", [(4, "kernel", "migrate"), (5, "kernel", "migrate"),
                                                (4, "kernel_ras", "migrate"), (4, "forged", "alert"),
                                                (5, "unconfirmed", "alert"), (4, None, "alert"), (0, None, "alert"),
                                                (-6, None, "alert"), (2, None, "alert"), (1, None, "alert"),
                                                (None, None, "alert"), (0, "kernel", "alert")])
def test_sigbus_migrates_only_for_a_memory_failure_the_kernel_sent(code, origin, action):
    from sentinel.config import PolicyConfig
    from sentinel.policy import Policy, PolicyState

    _, trips = Policy(PolicyConfig()).decide(PolicyState(), node_readings(rank_signal(code, origin=origin)), 100.0)
    assert [(t.rule, t.action) for t in trips] == [("rank_signal", action)]
    assert f"si_code {code}" in trips[0].message
    if code in (4, 5) and action == "alert":
        assert trips[0].cause == "rank_signal:SIGBUS:memory_failure_unconfirmed"
        assert "did not send" in trips[0].message


def test_a_non_memory_sigbus_does_not_swallow_a_later_memory_failure():
    """A user's kill -BUS or a forged memory-failure code (alerts) must not put the memory-failure
    migrate into cooldown."""
    from sentinel.config import PolicyConfig
    from sentinel.policy import Policy, PolicyState

    policy = Policy(PolicyConfig())
    state, first = policy.decide(PolicyState(), node_readings(rank_signal(0), rank_signal(4, origin="forged")), 100.0)
    _, second = policy.decide(state, node_readings(rank_signal(4, origin="kernel")), 101.0)
    assert [t.action for t in first] == ["alert", "alert"] and [t.action for t in second] == ["migrate"]


CHILD = r"""
import mmap, os, resource, signal, sys, threading
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
how, path = sys.argv[1], sys.argv[2]
print(os.getpid(), flush=True)
sys.stdin.readline()  # go: the probe watches this pid now
if how == "tkill":
    signal.pthread_kill(threading.main_thread().ident, signal.SIGBUS)
elif how in ("sigqueue", "tgsigqueue"):
    # forge a hardware memory failure: SIGBUS, si_code BUS_MCEERR_AR, sent to oneself (allowed)
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    info = ctypes.create_string_buffer(128)
    struct.pack_into("iiiiQ", info, 0, signal.SIGBUS, 0, 4, 0, 0x7F0000001000)  # signo errno code pad si_addr
    if how == "sigqueue":
        rc = libc.syscall(129, os.getpid(), signal.SIGBUS, info)  # rt_sigqueueinfo (x86-64)
    else:
        rc = libc.syscall(297, os.getpid(), threading.get_native_id(), signal.SIGBUS, info)  # rt_tgsigqueueinfo
    print("syscall failed", ctypes.get_errno(), flush=True)
elif how == "truncated_mmap":
    with open(path, "w+b") as f:
        f.write(b"\0" * 8192)
        f.flush()
        m = mmap.mmap(f.fileno(), 8192)
        f.truncate(0)
        m[4096] = 1  # past the end of the file now: the kernel sends SIGBUS, BUS_ADRERR
else:
    import time
    time.sleep(30)
"""


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_sigbus_that_is_not_a_memory_failure_carries_its_code_and_never_migrates(attacker, shared_tmp):
    require_ebpf("signal:signal_generate", "printk:console")
    from sentinel.config import PolicyConfig
    from sentinel.policy import Policy, PolicyState
    from sentinel.sources.rank_signals import RankSignalSource

    work = shared_tmp / "work"
    work.mkdir()
    os.chown(work, attacker.uid, attacker.gid)
    src = RankSignalSource(max_ranks=16)
    src.start()
    children = []
    try:
        assert src.up == {"ebpf_rank_signals": True}
        got = {}
        for how, want_code in (("kill", 0), ("tkill", -6), ("truncated_mmap", 2)):
            child = attacker.popen([SYSTEM_PYTHON, "-c", CHILD, how, str(work / f"{how}.bin")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(child)
            pid = int(child.stdout.readline())
            src.extra.add(pid)
            src.drain()  # syncs the watched pids
            child.stdin.write("go\n")
            child.stdin.flush()
            if how == "kill":
                assert attacker.run(["kill", "-BUS", str(pid)]).returncode == 0  # the user's own kill
            assert child.wait(timeout=20) == -signal.SIGBUS
            events = wait_for(lambda: [e for e in src.drain()[1] if e.detail["pid"] == pid] or None, timeout=10,
                              what=f"the SIGBUS of {how}")
            assert [(e.detail["signal"], e.detail["code"]) for e in events] == [("SIGBUS", want_code)], how
            got[how] = events[0]
            src.extra.discard(pid)
        counters = src.counters()
        assert counters[("sentinel_kernel_events", (("source", "ebpf_rank_signals"), ("kind", "SIGBUS_not_memory")))] == 3
        assert ("sentinel_kernel_events", (("source", "ebpf_rank_signals"), ("kind", "SIGBUS"))) not in counters
        _, trips = Policy(PolicyConfig()).decide(PolicyState(), node_readings(*got.values()), 100.0)
        assert sorted((t.rule, t.action) for t in trips) == [("rank_signal", "alert")] * 3
    finally:
        src.close()
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(timeout=10)


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_a_self_sent_memory_failure_sigbus_is_counted_alerted_and_never_migrates(attacker, shared_tmp):
    """The job's user forges a hardware memory failure: SIGBUS with si_code BUS_MCEERR_AR, sent to
    itself through rt_sigqueueinfo and rt_tgsigqueueinfo. The probe reads the kernel stack where
    the signal was generated: no force_sig_mceerr/send_sig_mceerr there, so the event is
    "forged", counted as SIGBUS_memory_failure_unconfirmed, and the policy only alerts."""
    require_ebpf("signal:signal_generate")
    from sentinel.config import PolicyConfig
    from sentinel.policy import Policy, PolicyState
    from sentinel.sources.rank_signals import RankSignalSource

    src = RankSignalSource(max_ranks=16)
    src.start()
    children = []
    try:
        events = []
        for how in ("sigqueue", "tgsigqueue"):
            child = attacker.popen([SYSTEM_PYTHON, "-c", CHILD, how, "-"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
            children.append(child)
            pid = int(child.stdout.readline())
            src.extra.add(pid)
            src.drain()
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(timeout=20) == -signal.SIGBUS, child.stdout.read()
            got = wait_for(lambda: [e for e in src.drain()[1] if e.detail["pid"] == pid] or None, timeout=10,
                           what=f"the SIGBUS of {how}")
            assert [(e.detail["code"], e.detail["memory_failure"]) for e in got] == [(4, "forged")], how
            events += got
            src.extra.discard(pid)
        counters = src.counters()
        key = ("sentinel_kernel_events", (("source", "ebpf_rank_signals"), ("kind", "SIGBUS_memory_failure_unconfirmed")))
        assert counters[key] == 2
        assert ("sentinel_kernel_events", (("source", "ebpf_rank_signals"), ("kind", "SIGBUS_memory_failure"))) not in counters
        state, trips = Policy(PolicyConfig()).decide(PolicyState(), node_readings(*events), 100.0)
        assert [(t.action, t.cause) for t in trips] == [("alert", "rank_signal:SIGBUS:memory_failure_unconfirmed")] * 2
    finally:
        src.close()
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait(timeout=10)


@pytest.mark.needs_root
def test_a_memory_failure_sigbus_is_confirmed_only_by_the_kernel_s_own_record():
    """How an event's kernel stack and the last ras:memory_failure_event are read: a stack through
    force_sig_mceerr (its real address on this kernel) is the kernel's; the rt_sigqueueinfo
    syscall's is forged; no stack and no record is unconfirmed; a memory_failure_event within
    the window confirms. (No kernel here sends a real one: it has no CONFIG_MEMORY_FAILURE.)"""
    import types

    from sentinel.sources.rank_signals import RAS_WINDOW_NS, RankSignalSource

    def kallsyms(name):
        for line in Path("/proc/kallsyms").read_text().splitlines():
            addr, _kind, sym = line.split()[:3]
            if sym == name:
                return int(addr, 16)
        pytest.fail(f"{name} is not in /proc/kallsyms")

    def event(frames, *, stack_bytes=None, mf=0, ts=10**12):
        kstack = list(frames) + [0] * (24 - len(frames))
        return types.SimpleNamespace(kstack=kstack, kstack_bytes=8 * len(frames) if stack_bytes is None else stack_bytes,
                                     memory_failure_ts_ns=mf, ts_ns=ts)

    src = RankSignalSource()
    mceerr = kallsyms("force_sig_mceerr") + 0x20  # a return address inside it
    queue = kallsyms("do_rt_sigqueueinfo") + 0x10
    assert src.memory_failure_origin(event([queue, mceerr])) == "kernel"
    assert src.memory_failure_origin(event([kallsyms("send_sig_mceerr") + 8])) == "kernel"
    assert src.memory_failure_origin(event([queue])) == "forged"
    assert src.memory_failure_origin(event([], stack_bytes=-14)) == "unconfirmed"
    assert src.memory_failure_origin(event([queue], mf=10**12 - RAS_WINDOW_NS // 2)) == "kernel_ras"
    assert src.memory_failure_origin(event([queue], mf=10**12 - 2 * RAS_WINDOW_NS)) == "forged"


# -- (3) planted files cannot blind the probe -----------------------------------------------------
@pytest.mark.parametrize("name,pid", [("1234.sock", 1234), ("1234.0af3.sock", 1234), ("4194304.sock", None),
                                      ("1.sock", None), ("0.sock", None), ("01234.sock", None), ("-5.sock", None),
                                      ("1234", None), ("1234.sock.bak", None), ("1234.XYZ.sock", None),
                                      ("1234.ABCD.sock", None), ("abc.sock", None), ("１２３.sock", None),
                                      ("1234.a.b.sock", None), ("99999999.sock", None)])
def test_rank_names(name, pid):
    from sentinel.sources.rank_signals import rank_pid

    assert rank_pid(name) == pid


@pytest.fixture
def ranks_dir(shared_tmp):
    d = shared_tmp / "ranks"
    d.mkdir()
    os.chmod(d, 0o1733)  # as the control channel makes it: anyone may create files there
    return d


def plant(attacker, ranks_dir: Path, n: int, junk: int = 0) -> None:
    code = (f"import os\nd = {str(ranks_dir)!r}\n"
            f"for i in range({n}): open(os.path.join(d, f'{{100000 + i}}.sock'), 'w').close()\n"
            f"for i in range({junk}): open(os.path.join(d, f'junk-{{i}}.sock'), 'w').close()\n")
    r = attacker.python(code)
    assert r.returncode == 0, r.stderr


def map_size(src) -> int:
    return sum(1 for _ in src.probe.table("ranks").keys())


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_1101_planted_files_do_not_overflow_the_map_or_stop_the_probe(attacker, ranks_dir):
    require_ebpf("signal:signal_generate", "printk:console")
    from sentinel.sources.rank_signals import RankSignalSource

    plant(attacker, ranks_dir, 1101, junk=50)
    src = RankSignalSource(ranks_dir, max_ranks=1024)
    src.start()  # used to raise: "Could not update table: Argument list too long"
    try:
        assert src.up == {"ebpf_rank_signals": True}
        for _ in range(3):
            assert src.drain() == ([], [])
        assert map_size(src) <= 1024
        assert len(src.watched) <= 1024
        full = src.counters()[("sentinel_ebpf_map_full", (("probe", "rank_signals"),))]
        assert full >= 1
        # a rank named on the command line is still watched and still seen
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            src.extra.add(child.pid)
            src.drain()
            assert child.pid in src.watched and map_size(src) <= 1024
            os.kill(child.pid, signal.SIGSEGV)
            events = wait_for(lambda: src.drain()[1] or None, timeout=10, what="the SIGSEGV")
            assert [(e.detail["pid"], e.detail["signal"]) for e in events] == [(child.pid, "SIGSEGV")]
        finally:
            child.kill()
            child.wait(timeout=10)
    finally:
        src.close()


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_a_ranks_provider_replaces_the_directory_and_its_failures_are_counted(attacker, ranks_dir):
    require_ebpf("signal:signal_generate", "printk:console")
    from sentinel.sources.rank_signals import RankSignalSource

    plant(attacker, ranks_dir, 20)
    verified = [os.getpid()]
    src = RankSignalSource(ranks_dir, max_ranks=8, ranks_provider=lambda: verified)
    src.start()
    try:
        assert src.watched == {os.getpid()}  # the planted names are not looked at
        verified = list(range(200000, 200020))  # more than the map holds
        src.drain()
        assert len(src.watched) == 8 and map_size(src) == 8
        assert src.counters()[("sentinel_ebpf_map_full", (("probe", "rank_signals"),))] >= 1

        def broken():
            raise RuntimeError("the channel is gone")

        src.ranks_provider = broken
        assert src.drain() == ([], [])
        assert src.counters()[("sentinel_ebpf_map_errors", (("probe", "rank_signals"), ("reason", "provider")))] == 1
    finally:
        src.close()


@pytest.mark.needs_root
@pytest.mark.needs_ebpf
def test_a_map_update_the_kernel_refuses_is_counted_not_raised():
    """The map filled behind the source's back (it is the kernel's): the update fails with E2BIG."""
    require_ebpf("signal:signal_generate", "printk:console")
    from sentinel.sources.rank_signals import RankSignalSource

    src = RankSignalSource(max_ranks=4)
    src.start()
    try:
        table = src.probe.table("ranks")
        import ctypes

        for pid in range(300000, 300004):
            table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        src.extra.add(os.getpid())
        assert src.drain() == ([], [])
        assert os.getpid() not in src.watched
        assert src.counters()[("sentinel_ebpf_map_full", (("probe", "rank_signals"),))] == 1
    finally:
        src.close()
