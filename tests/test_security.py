"""Attacks on the root daemon by a local unprivileged user, and faults an unlucky operator meets.

Each attack runs for real as a throwaway unprivileged user (the ``attacker`` fixture) and must
have no effect; each fault has its outcome asserted (node drained, nothing lost, loop alive).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import metric_value, register_agent, require_ebpf, wait_for
from sentinel import procs
from sentinel.channel import Ack, RankEndpoint
from sentinel.daemon_endpoint import DaemonEndpoint

pytestmark = pytest.mark.needs_root

# A stand-in for a training rank that is the agent itself (launched by `sentinel launch`): it
# answers every request with a staged and a committed ack, and records the SIGTERM of a drain.
FAKE_TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from sentinel.channel import Ack, RankEndpoint
    out = Path(sys.argv[2])
    ep = RankEndpoint.open(Path(sys.argv[1]))
    def term(*_):
        (out / "sigterm").write_text(str(os.getpid()))
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    (out / "ready").write_text(f"{ep.path}\\n{getattr(ep, 'error', '')}")
    end = time.time() + 120
    while time.time() < end:
        for r in ep.poll():
            ep.ack(Ack(id=r.id, rank=0, step=7, ok=True, phase="staged", bytes=1000, pid=os.getpid()))
            ep.ack(Ack(id=r.id, rank=0, step=7, ok=True, pid=os.getpid()))
            with open(out / "requests", "a") as f:
                f.write(r.id + "\\n")
        time.sleep(0.02)
""")


def launch_fake_trainer(runtime: Path, state: Path, out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "sentinel", "launch", "--pidfile", str(runtime / "agent.pid"),
                             "--state-dir", str(state), "--", sys.executable, "-c", FAKE_TRAINER, str(runtime), str(out)],
                            env={**os.environ, "SENTINEL_RUNTIME_DIR": str(runtime)})
    wait_for(lambda: (out / "ready").exists() and (runtime / "agent.pid").exists(), 20, what="fake trainer")
    return proc


def root_child(seconds: float = 60) -> subprocess.Popen:
    return subprocess.Popen(["sleep", str(seconds)])


def orphan(argv: list[str]) -> list[str]:
    """Run ``argv`` in the background of a shell that exits at once: the attacker's process is
    reparented to init, as any local user's would be — not a descendant of the test (which
    plays the agent in some tests)."""
    return ["sh", "-c", '"$@" &', "sh", *argv]


def bind_as(attacker, path: Path, seconds: float = 30) -> subprocess.Popen:
    """The attacker binds a datagram socket at ``path`` and keeps it (returns when it is bound)."""
    code = (f"import socket, time, os; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind({str(path)!r}); "
            f"print(os.getpid(), flush=True); time.sleep({seconds})")
    p = attacker.popen(orphan(["/usr/bin/python3", "-c", code]), stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), f"attacker could not bind {path}"
    p.attacker_pid = int(line)
    return p


def kill_attacker(p: subprocess.Popen) -> None:
    try:
        os.kill(p.attacker_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def runtime(shared_tmp):
    rd = shared_tmp / "run"
    rd.mkdir(mode=0o755)
    return rd


# -- 1. who counts as a rank -------------------------------------------------------------------------
def test_forged_rank_registrations_are_ignored_and_counted(attacker, runtime):
    ep = DaemonEndpoint(runtime)
    sleeper = root_child()
    try:
        # (a) no agent recorded: nothing counts, not even a real root socket
        own = attacker.python("import os; print(os.getpid())")
        atk = bind_as(attacker, runtime / "ranks" / "999991.sock")  # a pid that does not exist
        atk_own = bind_as(attacker, runtime / "ranks" / f"{os.getpid()}.sock.x")  # bad name
        assert ep.ranks() == {}
        # (b) the agent is recorded (this test process): the attacker's sockets still do not count
        register_agent(runtime)
        atk2 = attacker.popen(orphan(["/usr/bin/python3", "-c",
                               "import socket, os, sys, time; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                               f"s.bind({str(runtime / 'ranks')!r} + '/' + str(os.getpid()) + '.sock'); print(os.getpid(), flush=True); time.sleep(30)"]),
                              stdout=subprocess.PIPE, text=True)
        atk2.attacker_pid = int(atk2.stdout.readline())
        # (c) a plain file and a symlink named after a real job process (the sleeper is our child)
        (runtime / "ranks" / f"{sleeper.pid}.sock").symlink_to("/dev/null")
        rank = RankEndpoint.open(runtime)  # the genuine rank: this test process, the agent itself
        ranks = ep.ranks()
        assert set(ranks) == {os.getpid()}
        assert ep.rejected["not_in_job"] >= 1 and ep.rejected["not_socket"] >= 1 and ep.rejected["bad_name"] >= 1
        assert ep.request("migrate", "m1", "test") == 1  # only the genuine rank is asked
        m = ep.metric_counters()
        assert m[("sentinel_channel_rejected", (("reason", "not_in_job"),))] >= 1
        rank.close()
        for p in (atk, atk_own, atk2):
            kill_attacker(p)
        assert own.returncode == 0
    finally:
        sleeper.kill()
        ep.close()


def test_a_socket_named_after_a_job_process_but_owned_by_someone_else_is_refused(attacker, runtime):
    register_agent(runtime)
    ep = DaemonEndpoint(runtime)
    child = root_child()  # a real process of the job (our descendant), running as root
    try:
        atk = bind_as(attacker, runtime / "ranks" / f"{child.pid}.sock")
        assert ep.ranks() == {} and ep.rejected["owner_mismatch"] == 1
        kill_attacker(atk)
    finally:
        child.kill()
        ep.close()


def test_acks_from_anyone_but_the_ranks_asked_are_refused(attacker, runtime):
    register_agent(runtime)
    ep = DaemonEndpoint(runtime)
    rank = RankEndpoint.open(runtime)
    try:
        assert ep.request("migrate", "m1", "test") == 1
        forged = Ack(id="m1", rank=0, step=1, ok=True).encode()
        send = (f"import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                f"s.sendto({forged!r}, {str(runtime / 'daemon.sock')!r})")
        r = attacker.python(send)  # another user cannot reach daemon.sock at all
        assert r.returncode != 0 and "PermissionError" in r.stderr
        # a process of the job's user and group (here root) that was not asked: refused by pid
        r = subprocess.run([sys.executable, "-c", send], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: ep.poll_acks() == [] and ep.rejected["ack_not_expected"] == 1, 5, what="the refusal")
        assert not ep.complete("m1")
        rank.ack(Ack(id="m1", rank=0, step=1, ok=True))
        acks = wait_for(ep.poll_acks, 5, what="the genuine ack")
        assert acks[0].pid == os.getpid() and ep.complete("m1")
    finally:
        rank.close()
        ep.close()


def test_a_squatted_rank_socket_is_reported_and_the_rank_still_reachable(attacker, runtime):
    """The attacker squats the name of a rank that is about to start; the rank (a job running as
    an unprivileged user, here nobody: a root rank would simply take its name back) binds an
    unpredictable name, says so, and the daemon still reaches it."""
    code = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from sentinel.channel import Ack, RankEndpoint
        print(os.getpid(), flush=True)
        sys.stdin.readline()  # wait until the name is squatted
        ep = RankEndpoint.open(Path({str(runtime)!r}))
        print(ep.path.name, "|", ep.error, flush=True)
        end = time.time() + 20
        while time.time() < end:
            for r in ep.poll():
                ep.ack(Ack(id=r.id, rank=0, step=3, ok=True))
                print("acked", flush=True)
                sys.exit(0)
            time.sleep(0.02)
    """)
    rank = subprocess.Popen(["/usr/bin/python3", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            user=65534, group=65534, extra_groups=[],
                            env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": "/usr/bin:/bin"})
    ep = None
    try:
        pid = int(rank.stdout.readline())
        register_agent(runtime, pid)  # the rank is the agent: the job is nobody's
        ep = DaemonEndpoint(runtime)
        atk = bind_as(attacker, runtime / "ranks" / f"{pid}.sock")
        rank.stdin.write("go\n")
        rank.stdin.flush()
        name, error = rank.stdout.readline().split("|")
        assert name.strip() != f"{pid}.sock" and name.strip().startswith(f"{pid}.")
        assert "squatted" in error and str(attacker.uid) in error
        assert ep.request("migrate", "m1", "test") == 1
        assert rank.stdout.readline().strip() == "acked"
        wait_for(lambda: ep.poll_acks() or ep.complete("m1"), 5, what="ack")
        assert ep.complete("m1") and ep.rejected["owner_mismatch"] == 1
        kill_attacker(atk)
    finally:
        rank.kill()
        if ep is not None:
            ep.close()


def test_planted_files_cannot_blind_the_channel(attacker, runtime):
    ep = DaemonEndpoint(runtime, max_ranks=64)
    r = attacker.run(["sh", "-c", f"cd {runtime / 'ranks'} && for i in $(seq 2 1102); do : > $i.sock; done"])
    assert r.returncode == 0, r.stderr
    register_agent(runtime)
    rank = RankEndpoint.open(runtime)
    try:
        t0 = time.perf_counter()
        ranks = ep.ranks()
        assert time.perf_counter() - t0 < 2.0
        assert len(ranks) <= 64
        assert ep.rejected["not_socket"] + ep.rejected["too_many_entries"] >= 1
    finally:
        rank.close()
        ep.close()


@pytest.mark.needs_ebpf
def test_planted_files_and_a_self_sigbus_neither_blind_nor_trigger_the_daemon(attacker, shared_tmp, sim_state,
                                                                               start_daemon, tmp_path):
    """The reproduced attack end to end, with the eBPF rank-signal probe loaded: 1,101 planted
    files, a forged registration and `kill -BUS` on itself. The loop keeps publishing, nothing
    migrates, and a restart on the same directory starts."""
    require_ebpf("signal:signal_generate")
    runtime = shared_tmp / "run"
    state = shared_tmp / "state"
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), runtime_dir=runtime, ebpf=True)
    r = attacker.run(["sh", "-c", f"cd {runtime / 'ranks'} && for i in $(seq 2 1102); do : > $i.sock; done"])
    assert r.returncode == 0, r.stderr
    # Its own pid may be one of the planted names (2-1102; a fresh VM's pids are low): it removes
    # its own planted file first (EADDRINUSE once failed CI).
    code = ("import socket, os, signal, time; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            f"p = {str(runtime / 'ranks')!r} + '/' + str(os.getpid()) + '.sock'; "
            "os.path.lexists(p) and os.unlink(p); s.bind(p); time.sleep(2.5); "
            "os.kill(os.getpid(), signal.SIGBUS)")
    r = attacker.run(["/usr/bin/python3", "-c", code])
    assert r.returncode == -signal.SIGBUS
    t = d.status["time"]
    wait_for(lambda: d.status["time"] > t + 2, 15, what="the loop to keep publishing")
    text = d.scrape()
    assert d.status["migration"] is None and not d.status["cordoned"]
    assert not (state / "cordon.json").exists()
    assert (metric_value(text, "sentinel_channel_rejected_total", reason="no_agent") or 0) >= 1
    assert d.stop() == 0
    d2 = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), runtime_dir=runtime, ebpf=True)
    assert d2.proc.poll() is None


FORGING_RANK = textwrap.dedent("""
    import ctypes, os, signal, struct, sys, time
    from pathlib import Path
    from sentinel.channel import RankEndpoint
    out = Path(sys.argv[2])
    ep = RankEndpoint.open(Path(sys.argv[1]))
    (out / "ready").write_text(str(os.getpid()))
    end = time.time() + 60
    while not (out / "go").exists() and time.time() < end:
        ep.poll()
        time.sleep(0.05)
    info = ctypes.create_string_buffer(128)
    struct.pack_into("iiiiQ", info, 0, signal.SIGBUS, 0, 4, 0, 0x7F0000001000)  # BUS_MCEERR_AR
    ctypes.CDLL(None).syscall(129, os.getpid(), signal.SIGBUS, info)  # rt_sigqueueinfo to itself
""")


@pytest.mark.needs_ebpf
def test_a_rank_that_forges_a_memory_failure_on_itself_drains_nothing(shared_tmp, sim_state, start_daemon):
    """The job's own verified rank sends itself SIGBUS with si_code BUS_MCEERR_AR (rt_sigqueueinfo,
    which the kernel allows): the daemon sees it (counted as an unconfirmed memory failure, the
    alert's metric) and neither migrates nor cordons."""
    require_ebpf("signal:signal_generate")
    runtime, state, out = shared_tmp / "run", shared_tmp / "state", shared_tmp / "out"
    out.mkdir()
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), runtime_dir=runtime, ebpf=True)
    job = subprocess.Popen([sys.executable, "-m", "sentinel", "launch", "--pidfile", str(runtime / "agent.pid"),
                            "--state-dir", str(state), "--", sys.executable, "-c", FORGING_RANK, str(runtime), str(out)],
                           env={**os.environ, "SENTINEL_RUNTIME_DIR": str(runtime)})
    try:
        wait_for(lambda: (out / "ready").exists() and (runtime / "agent.pid").exists(), 20, what="the rank")
        t = d.status["time"]
        wait_for(lambda: d.status["time"] > t + 2, 15, what="the daemon to watch the rank")
        (out / "go").write_text("")
        job.wait(timeout=30)

        def counted():
            return metric_value(d.scrape(), "sentinel_kernel_events_total", source="ebpf_rank_signals",
                                kind="SIGBUS_memory_failure_unconfirmed")

        assert wait_for(counted, 15, what="the forged signal to be counted") == 1
        t = d.status["time"]
        wait_for(lambda: d.status["time"] > t + 1, 15, what="the loop to go on")
        assert d.status["migration"] is None and not d.status["cordoned"]
        assert not (state / "cordon.json").exists() and not (state / "migration.json").exists()
        assert metric_value(d.scrape(), "sentinel_kernel_events_total", source="ebpf_rank_signals",
                            kind="SIGBUS_memory_failure") is None
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=10)


# -- 6. the agent pidfile ------------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["-1\n", "0\n", "1\n", "garbage\n", '-1\n{"pid":-1,"start_time":0,"exe":"","uid":0,"boot_id":""}\n'])
def test_pidfiles_that_would_signal_the_wrong_processes_are_refused(tmp_path, content):
    pidfile = tmp_path / "agent.pid"
    pidfile.write_text(content)
    with pytest.raises(procs.NotTrusted):
        procs.read_agent_record(pidfile)


def test_a_stale_or_reused_pid_is_never_signalled(tmp_path):
    victim = root_child()
    try:
        rec = procs.AgentRecord.of(victim.pid)
        forged = procs.AgentRecord(rec.pid, rec.start_time + 1, rec.exe, rec.uid, rec.boot_id)  # "another process"
        pidfile = tmp_path / "agent.pid"
        procs.write_agent_record(pidfile, forged)
        with pytest.raises(procs.NotTrusted):
            procs.read_agent_record(pidfile)
        with pytest.raises(procs.NotTrusted):
            procs.signal_agent(forged, signal.SIGTERM)
        assert victim.poll() is None  # still alive
        procs.write_agent_record(pidfile, rec)
        procs.signal_agent(procs.read_agent_record(pidfile), signal.SIGTERM)
        assert victim.wait(5) == -signal.SIGTERM
        with pytest.raises(procs.NotTrusted):  # exited: refused, not "kill a reused pid"
            procs.read_agent_record(pidfile)
    finally:
        victim.kill()


def test_a_pidfile_that_is_a_symlink_or_owned_by_someone_else_is_refused(attacker, shared_tmp):
    victim = root_child()
    try:
        real = shared_tmp / "real.pid"
        procs.write_agent_record(real, procs.AgentRecord.of(victim.pid))
        link = shared_tmp / "agent.pid"
        link.symlink_to(real)
        with pytest.raises(procs.NotTrusted, match="symlink"):
            procs.read_agent_record(link)
        os.chown(real, attacker.uid, attacker.gid)
        with pytest.raises(procs.NotTrusted, match="owned by uid"):
            procs.read_agent_record(real)
        assert victim.poll() is None
    finally:
        victim.kill()


def test_launch_never_writes_through_a_planted_symlink(attacker, shared_tmp):
    victim_file = shared_tmp / "victim"
    victim_file.write_text("precious\n")
    drop = shared_tmp / "drop"
    drop.mkdir(mode=0o1777)
    drop.chmod(0o1777)
    r = attacker.run(["ln", "-s", str(victim_file), str(drop / "agent.pid")])
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "sentinel", "launch", "--pidfile", str(drop / "agent.pid"),
                        "--state-dir", str(shared_tmp / "state"), "--", "sh", "-c", "sleep 0.5"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert victim_file.read_text() == "precious\n"


# -- 7. directories and files ---------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["runtime", "state"])
def test_daemon_refuses_directories_others_can_write(which, attacker, shared_tmp, sim_state):
    runtime, state = shared_tmp / "run", shared_tmp / "state"
    for d in (runtime, state):
        d.mkdir()
    bad = runtime if which == "runtime" else state
    bad.chmod(0o777)
    r = subprocess.run([sys.executable, "-m", "sentinel", "run", "--simulate", str(sim_state), "--runtime-dir", str(runtime),
                        "--state-dir", str(state), "--port", "0", "--no-ebpf"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and str(bad) in r.stderr and "chmod go-w" in r.stderr
    assert not (runtime / "daemon.sock").exists()
    bad.chmod(0o755)
    os.chown(bad, attacker.uid, attacker.gid)
    r = subprocess.run([sys.executable, "-m", "sentinel", "run", "--simulate", str(sim_state), "--runtime-dir", str(runtime),
                        "--state-dir", str(state), "--port", "0", "--no-ebpf"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and str(bad) in r.stderr and "chown root" in r.stderr


def test_a_planted_cordon_marker_does_not_block_migrations(tmp_path):
    from test_migration import TRIP, make

    state = tmp_path / "state"
    state.mkdir()
    (state / "cordon.json").write_text("not json")
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    try:
        m = make(tmp_path, ep)
        assert not m.cordoned and m.counts["cordon_marker_invalid"] == 1 and not (state / "cordon.json").exists()
        m.begin("r1", TRIP)
        assert m.active
    finally:
        ep.close()


# -- 9, 10, 11. faults: a full disk, slow commands, a clock step ----------------------------------------
def _config(path: Path, **actions) -> Path:
    lines = ["[daemon]", "poll_interval_seconds = 0.5", "[actions]"]
    if any(k.endswith("_command") for k in actions):
        actions.setdefault("backend", "command")
    for k, v in actions.items():
        lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_tmpfs(shared_tmp):
    mnt = shared_tmp / "state"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0750", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_state_dir_still_drains_and_the_loop_lives(fault, tiny_tmpfs, shared_tmp, sim_state,
                                                                       start_daemon, tmp_path):
    from sentinel.sources import simulated

    runtime, state, out = shared_tmp / "run", tiny_tmpfs, shared_tmp / "trainer"
    runtime.mkdir(mode=0o755)
    cordoned = shared_tmp / "cordoned-by-command"
    cfg = _config(tmp_path / "s.toml", cordon_command=["touch", str(cordoned)], ack_timeout_seconds=20.0)
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), "--config", str(cfg), runtime_dir=runtime)
    agent = launch_fake_trainer(runtime, state, out)
    try:
        if fault == "full":
            subprocess.run(["dd", "if=/dev/zero", f"of={state}/fill", "bs=4k", "count=1000"], capture_output=True)
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
        simulated.inject(sim_state, 1, ["xid=79"])
        wait_for(lambda: (out / "sigterm").exists(), 20, what="the agent stopped by the drain")
        assert cordoned.exists()  # cordoned through the command although the marker could not be written
        assert agent.wait(10) == 0
        t = d.status["time"]
        wait_for(lambda: d.status["time"] > t + 1, 10, what="the loop to keep publishing")
        status = d.status
        assert status["migration"]["phase"] == "drained" and status["cordoned"]
        text = d.scrape()
        assert metric_value(text, "sentinel_migration_steps_total", step="state_write_failed") >= 1
        assert d.proc.poll() is None
    finally:
        agent.kill()


def test_slow_commands_never_stop_the_loop_or_the_watchdog(shared_tmp, sim_state, start_daemon, tmp_path):
    from sentinel.sources import simulated

    runtime, state, out = shared_tmp / "run", shared_tmp / "state", shared_tmp / "trainer"
    runtime.mkdir(mode=0o755)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(0.2)
    done = tmp_path / "cordon-done"
    cfg = _config(tmp_path / "s.toml", cordon_command=["sh", "-c", f"sleep 6; : > {done}"], command_timeout_seconds=20.0)
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), "--config", str(cfg), runtime_dir=runtime,
                     env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    agent = launch_fake_trainer(runtime, state, out)
    try:
        simulated.inject(sim_state, 1, ["xid=79"])
        wait_for(lambda: (d.status.get("migration") or {}).get("phase") == "cordoned" or
                 (out / "requests").exists(), 180, what="the migration to start")  # 60 s ran out beside another suite
        # Until the drain (the agent's SIGTERM): the watchdog pings go on while the cordon command
        # sleeps, never further apart than systemd allows (WatchdogSec=30s), and the drain comes
        # only after the command finished. Bounded: 60 s.
        pings_during, last, gap = 0, time.monotonic(), 0.0
        drained_after_cordon = None
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if (out / "sigterm").exists():
                drained_after_cordon = done.exists()
                break
            try:
                got = notify.recv(4096).count(b"WATCHDOG=1")
            except socket.timeout:
                continue
            if got:
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                pings_during += got if not done.exists() else 0
        assert drained_after_cordon is True, "the drain did not wait for the cordon step (or never came)"
        assert pings_during >= 1 and gap < 30, f"{pings_during} watchdog pings while the cordon command ran, gap {gap:.1f} s"
    finally:
        agent.kill()
        notify.close()


def test_a_restarted_daemon_resends_the_pending_request_with_the_same_id(tmp_path):
    from test_migration import TRIP, make

    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep)
        m.begin("r1", TRIP)
        first = rank.poll()
        assert [r.id for r in first] == ["r1"] and first[0].hold_seconds >= 120
        m2 = make(tmp_path, ep)  # restart
        m2.tick([])
        again = rank.poll()
        assert [r.id for r in again] == ["r1"]
    finally:
        rank.close()
        ep.close()


def test_a_wall_clock_step_does_not_cut_the_ack_wait_short(tmp_path):
    from test_migration import TRIP, make

    class Jumping:
        t = 1_000_000.0

        def __call__(self):
            return self.t

    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    wall = Jumping()
    try:
        m = make(tmp_path, ep)
        m.wall = wall
        m.clock = time.monotonic  # the real monotonic clock, as in the daemon
        m.begin("r1", TRIP)
        wall.t += 3600  # +1 h clock step
        m.tick([])
        assert m.record.phase == "requested" and not m.cordoned
    finally:
        rank.close()
        ep.close()


def test_staged_acks_extend_the_deadline_by_the_snapshot_size(tmp_path):
    from test_migration import TRIP, Clock, advance, make

    clock = Clock()
    register_agent(tmp_path / "run")
    ep = DaemonEndpoint(tmp_path / "run")
    rank = RankEndpoint.open(tmp_path / "run")
    try:
        m = make(tmp_path, ep, clock=clock, ack_timeout_seconds=10.0, snapshot_min_bytes_per_second=1e6)
        m.begin("r1", TRIP)
        rank.ack(Ack(id="r1", rank=0, step=4, ok=True, phase="staged", bytes=50_000_000))  # 50 s at 1 MB/s
        m.tick(wait_for(ep.poll_acks, 5, what="staged ack"))
        clock.t += 30  # past the plain ack timeout, within the size allowance
        advance(m)
        assert m.record.phase == "requested" and m.record.staged_bytes == 50_000_000
        rank.ack(Ack(id="r1", rank=0, step=4, ok=True))
        advance(m, wait_for(ep.poll_acks, 5, what="committed ack"))
        assert m.record.phase == "drained" and m.record.snapshot_step == 4
    finally:
        rank.close()
        ep.close()
