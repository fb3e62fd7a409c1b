"""Shared fixtures. In CI (CI=true) every skip is a failure — a test skipped at run time and a
whole module skipped at collection (``pytest.importorskip`` at module level) alike: skips are only
for developer laptops, and CI installs everything (scripts/setup fails when it could not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# One Slurm cluster and one kube-apiserver per test session, started by the first test that asks
# (registered here once: a module importing the fixture itself would get a cluster of its own)
from kube_cluster import kube, stop_session_cluster  # noqa: E402,F401
from slurm_cluster import slurm  # noqa: E402,F401
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_ci_skips: list[str] = []


# -- side by side (pytest-xdist, scripts/test) ----------------------------------------------------
# Tests run on several workers at once (--dist loadgroup). What a test shares with the whole
# machine decides its group, and a group runs on one worker, one test at a time:
# - "kernel": tests that write lines into the host's kernel log (/dev/kmsg, eBPF tracepoints) or
#   boot a systemd whose daemon reads it; every other test's daemon runs with --no-kernel-log
#   (start_daemon), and the drills' daemons are configured so, so none of them acts on these lines;
# - "slurm" and "kube": the one cluster of the session (a session fixture lives per worker);
# - a file of MODULE_FIXTURE_FILES (below): its module fixture.
KERNEL_FILES = {"test_ebpf.py", "test_kernel_signatures_e2e.py", "test_kernel_trust.py", "test_log_formats.py",
                "test_packaging.py", "test_prometheus.py", "test_security.py", "test_signature_trust.py",
                "test_systemd_nspawn.py", "test_image_kernel.py"}
# ... but for these tests of such files, which neither write kernel lines nor start a daemon that
# reads them: the kernel group is one worker's queue, a test outside it runs beside it
KERNEL_FREE_TESTS = {  # a venv with prometheus-client at its floor runs the metric tests (their daemons: --no-kernel-log)
    "test_packaging.py::test_the_metric_tests_pass_with_the_lowest_prometheus_client_allowed"}

# Files whose tests share a costly module-scoped fixture: a module fixture lives per worker, so
# their tests on several workers would each make it (two `podman load`s of the image were 38 s and
# 45 s of setup in one CI run). Each such file is a group of its own: one worker, one fixture.
MODULE_FIXTURE_FILES = {"test_image.py",  # the image built and loaded into a podman store
                        "test_topology_slurm.py"}  # a Slurm cluster with a switch tree


def xdist_group_of(item) -> str | None:
    names = set(getattr(item, "fixturenames", ()))
    if "slurm" in names:
        return "slurm"
    if "kube" in names:
        return "kube"
    if item.path.name in KERNEL_FILES and f"{item.path.name}::{item.name}" not in KERNEL_FREE_TESTS:
        return "kernel"
    if item.path.name == "test_netns_hosts.py":  # a drill of 7 hosts x ~10 processes each: one at a time
        return "netns"
    if item.path.name in MODULE_FIXTURE_FILES:
        return item.path.stem
    return None


# Files whose tests run whole jobs (torchrun, drills, a booted systemd): handed out first, so the
# workers do not end the run waiting on one long test started last (longest first). A stable
# sort: every worker computes the same order, as pytest-xdist requires.
LONG_FILES = ("test_netns_hosts.py", "test_drill.py", "test_trainer.py", "test_memory_tier.py", "test_bench_smoke.py",
              "test_slurm_drill.py", "test_systemd_nspawn.py", "test_elastic.py", "test_replacement_scale.py",
              "test_slot_rendezvous.py", "test_etcd_rendezvous.py", "test_topology_drill.py", "test_progress.py",
              "test_hang_job.py", "test_lightning.py", "test_torchtitan.py", "test_peers_bench.py",
              "test_kubelet.py", "test_image.py", "test_dashboard.py")


# Before those, the tests outside a group that took over a minute each in a CI run (scripts/test
# prints the 30 slowest: ci16a/b, ci17a), longest first: started last, one of them alone would be the run's tail.
# (A group is one unit of work: pytest-xdist hands the groups out first, the most tests first.)
LONGEST_TESTS = ("test_peers_bench.py::test_smoke_kills_node1_at_the_same_step_for_sentinel_and_torch_elastic",
                 "test_lightning.py::test_a_stock_lightning_job_resumed_twice_across_an_epoch_end_is_bitwise_equal",
                 "test_torchtitan.py::test_restarted_job_resumes_through_torchtitans_load_and_ends_bitwise_equal",
                 "test_torchtitan.py::test_xid79_makes_torchtitan_save_now_and_the_spare_load_it_with_no_lost_step",
                 "test_drill.py::test_two_nodes_fail_at_once",
                 "test_drill.py::test_a_hung_rank_alone_on_its_node_is_handed_over_by_the_forwarded_verdict",
                 "test_bench_smoke.py::test_bench_smoke[memory_tier]",
                 "test_bench_smoke.py::test_migration_killed_mid_run_keeps_the_finished_drills",
                 "test_lightning.py::test_xid79_hands_a_lightning_job_to_the_spare_with_no_lost_step_and_bitwise_equal_result",
                 "test_packaging.py::test_the_metric_tests_pass_with_the_lowest_prometheus_client_allowed")


def run_order(item) -> tuple[int, int]:
    for name in (f"{item.path.name}::{item.name}", f"{item.path.name}::{getattr(item, 'originalname', item.name)}"):
        if name in LONGEST_TESTS:  # a test by its name with its parameters, or all its parametrisations
            return 0, LONGEST_TESTS.index(name)
    return 1, LONG_FILES.index(item.path.name) if item.path.name in LONG_FILES else len(LONG_FILES)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (it appends them to the node ids)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = xdist_group_of(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=run_order)


# -- two suites on one host ------------------------------------------------------------------------
# The kernel log is the host's: a second suite on the same machine (CI beside a developer's run)
# writes Xid lines about the same simulated bus ids, and the kernel group's daemons of each would
# act on the other's lines. The kernel group therefore holds a host-wide lock (flock: released
# when its holder dies) from the setup of its first test to the teardown of its last, so the
# module fixtures (a booted systemd) are inside it; the other suite's kernel group waits for it
# while its other workers go on.
KERNEL_LOCK = Path("/tmp/sentinel-tests-kernel-log.lock")
KERNEL_LOCK_WAIT_S = 2700  # another suite's whole kernel group, on a host running two suites
_kernel_log = {"left": 0, "fd": None}


def in_kernel_group(item) -> bool:
    mark = item.get_closest_marker("xdist_group")
    return mark is not None and mark.args[:1] == ("kernel",)


def pytest_collection_finish(session):
    _kernel_log["left"] = sum(1 for item in session.items if in_kernel_group(item))
    _kube["left"] = sum(1 for item in session.items if uses_kube(item))


def _take_kernel_log() -> None:
    import fcntl

    try:
        fd = os.open(KERNEL_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:  # another user's suite made it: flock works on a read-only descriptor too
        fd = os.open(KERNEL_LOCK, os.O_RDONLY)
    deadline = time.monotonic() + KERNEL_LOCK_WAIT_S
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                pytest.fail(f"another test suite on this host held {KERNEL_LOCK} (the kernel log) for "
                            f"{KERNEL_LOCK_WAIT_S} s")
            if not waited:
                sys.stderr.write(f"\nwaiting for another suite's kernel-log tests ({KERNEL_LOCK})\n")
                waited = True
            time.sleep(1.0)
    _kernel_log["fd"] = fd


def _give_kernel_log() -> None:
    fd, _kernel_log["fd"] = _kernel_log["fd"], None
    if fd is not None:
        os.close(fd)  # releases the flock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if in_kernel_group(item) and _kernel_log["fd"] is None:
        _take_kernel_log()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if in_kernel_group(item):
        _kernel_log["left"] -= 1
        if _kernel_log["left"] <= 0 or nextitem is None:
            _give_kernel_log()
    if uses_kube(item):
        _kube["left"] -= 1
    if _kube["left"] <= 0 and (nextitem is None or nextitem.path != item.path):
        stop_session_cluster()


# -- the session's kube-apiserver, stopped after the last test that uses it ---------------------------
# An idle kube-apiserver and its etcd spend ~1.5 CPU-s a minute (measured). Its group is handed out
# first, so the cluster ran from the run's start to its end for ~45 s of tests: ~30-40 CPU-s for
# nothing (ci18a and ci18b charged 38 and 41 CPU-s of it to the last test of that worker). Every
# test using it is of the "kube" group, so one worker runs them all: once it has run the last of
# them and left that test's file (pytest ends a file's module fixtures, some of which call the
# apiserver at their teardown, when the next test is another file's), the cluster stops. A worker
# that runs only some of them (another --dist, a test of the slurm group that also uses kube) never
# counts down to 0 and keeps it to the session's end, as before.
_kube = {"left": 0}


def uses_kube(item) -> bool:
    return "kube" in getattr(item, "fixturenames", ())


# -- made once per session, shared by the workers -----------------------------------------------------
def session_shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory of this test session that every xdist worker sees (the workers' temporary
    directories are siblings under one per-session directory; their test run has one id)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    d = base.parent / f"{name}-{run}" if run else base / name
    d.mkdir(exist_ok=True)
    return d


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A directory ``make(directory)`` fills once per test session, shared by every xdist worker:
    the first worker to ask makes it while the others wait on a file lock (released when closed,
    or when its holder dies); they all get the same path. For an expensive input several tests
    read (a reference run, snapshots to resume from), without an xdist group queueing those tests
    on the one worker that would hold a module fixture. A ``make`` that fails leaves nothing: the
    next worker to ask tries again in a new directory."""
    import fcntl
    import tempfile

    root = session_shared_dir(tmp_path_factory, "made-once")
    made = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.is_dir():
            attempt = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
            make(attempt)
            os.rename(attempt, made)
    return made


def job_launcher(nproc: int, *, forked: bool) -> list[str]:
    """The command that starts a job script's ``nproc`` ranks: plain ``torchrun --standalone``
    (nproc + 1 interpreters that each import torch and the job's libraries), or, where the
    launcher is not what a test is about, tests/workers/forkrun.py (the script imported once, each
    rank a fork with torchrun's environment: about half the CPU)."""
    if forked:
        return [sys.executable, str(REPO / "tests" / "workers" / "forkrun.py"), "--nproc", str(nproc)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


# -- where the suite's CPU goes (SENTINEL_TEST_CPU=FILE) ---------------------------------------------
# The suite is mostly CPU-bound on 2 cores (the report's host line says how idle they were). With the variable
# set, each test appends {"test", "cpu_s", "wall_s", "start", "worker", "group", "host_cpu"} to FILE:
# the CPU of the pytest worker and of every child it waited for (torchrun and its ranks, daemons,
# clusters' clients), setup and teardown included, and the host's busy and idle CPU seconds so far
# at its start and at its end. `python tests/cpu_report.py FILE` sums it per test, per
# file, per xdist group and per worker (when each worker started and ended: the run's tail).
CPU_LOG = os.environ.get("SENTINEL_TEST_CPU")


def _cpu_now() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _host_cpu() -> list[float]:
    """The whole host's CPU seconds so far, [busy, idle] (/proc/stat: idle counts iowait too): what
    the tests' own figures leave out (processes nobody waited for, other users) and how long the
    CPUs sat idle while the workers waited."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    return [round((sum(fields) - idle) / tick, 2), round(idle / tick, 2)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_LOG:
        yield
        return
    cpu0, t0, start, host0 = _cpu_now(), time.monotonic(), time.time(), _host_cpu()
    yield
    mark = item.get_closest_marker("xdist_group")
    row = {"test": item.nodeid, "cpu_s": round(_cpu_now() - cpu0, 2), "wall_s": round(time.monotonic() - t0, 2),
           "start": round(start, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
           "group": mark.args[0] if mark and mark.args else None, "host_cpu": [host0, _host_cpu()]}
    with open(CPU_LOG, "a") as f:  # one short line per write: appends from several workers do not interleave
        f.write(json.dumps(row) + "\n")


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"CI=true: this test must not skip ({_skip_reason(report)})"


def pytest_collectreport(report):
    # A module-level skip never reaches pytest_runtest_makereport: it is a collection report.
    if IN_CI and report.skipped:
        _ci_skips.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_terminal_summary(terminalreporter):
    if _ci_skips:
        terminalreporter.section("CI=true: skipped at collection (fails the run)", sep="=", red=True)
        for line in _ci_skips:
            terminalreporter.line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _ci_skips and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def require_ebpf(*tracepoints: str) -> None:
    """Skip (a failure under CI=true) unless this process can load BPF programs through bcc and
    each ``category:event`` tracepoint exists (default: printk:console)."""
    if os.geteuid() != 0:
        pytest.skip("eBPF needs root")
    from sentinel.sources.ebpf import EbpfUnavailable, import_bcc, tracepoint_exists

    try:
        import_bcc()
    except EbpfUnavailable as exc:
        pytest.skip(str(exc))
    for tp in tracepoints or ("printk:console",):
        if not tracepoint_exists(*tp.split(":")):
            pytest.skip(f"tracepoint {tp} is missing (is tracefs mounted? mount -t tracefs nodev /sys/kernel/tracing)")


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; bounded in time."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class DaemonProcess:
    def __init__(self, proc: subprocess.Popen, runtime_dir: Path, log_path: Path) -> None:
        self.proc = proc
        self.runtime_dir = runtime_dir
        self.log_path = log_path

    @property
    def status(self) -> dict:
        return json.loads((self.runtime_dir / "status.json").read_text())

    @property
    def port(self) -> int:
        return self.status["metrics_port"]

    def scrape(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # returns as soon as it exits; an eBPF daemon's teardown took > 5 s at load 20 (two suites)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


@pytest.fixture
def sim_state(tmp_path):
    from sentinel.sources import simulated

    path = tmp_path / "gpus.json"
    simulated.write_state(path, simulated.healthy_state(4))
    return path


@pytest.fixture
def start_daemon(tmp_path, request):
    reads_kernel = request.node.path.name in KERNEL_FILES
    started: list[DaemonProcess] = []

    def start(*args: str, runtime_dir: Path | None = None, env: dict | None = None, wait: bool = True,
              ebpf: bool = False, kernel: bool | None = None) -> DaemonProcess:
        rd = runtime_dir or tmp_path / f"run{len(started)}"
        log_path = tmp_path / f"daemon{len(started)}.log"
        cmd = [sys.executable, "-m", "sentinel", "run", "--runtime-dir", str(rd), "--port", "0",
               "--listen-address", "127.0.0.1", "--state-dir", str(tmp_path / "state"), *args]
        if not ebpf and "--no-ebpf" not in args:
            cmd.append("--no-ebpf")  # eBPF tests ask for it; others skip the ~2 s compile
        if not ebpf and not (reads_kernel if kernel is None else kernel):
            # tests run side by side (pytest-xdist): only a test of the "kernel" group (those that
            # write kernel lines, one at a time on one worker) reads the host's kernel log
            cmd.append("--no-kernel-log")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
        d = DaemonProcess(proc, rd, log_path)
        started.append(d)
        if wait:
            def ready():
                if proc.poll() is not None:
                    raise AssertionError(f"daemon exited {proc.returncode}: {log_path.read_text()}")
                return (rd / "status.json").exists()

            wait_for(ready, timeout=120, what="daemon status.json")  # an eBPF compile under load: 20 s was not enough beside another suite
        return d

    yield start
    for d in started:
        d.stop()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus exposition text, or None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


# -- an unprivileged local user, for attacks on a root daemon ---------------------------------------
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class Attacker:
    """A throwaway unprivileged user (created for the session, removed after). ``run`` and
    ``python`` execute as that user with no supplementary groups."""

    def __init__(self, name: str, uid: int, gid: int) -> None:
        self.name, self.uid, self.gid = name, uid, gid

    def run(self, argv, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", **kw.pop("env", {})}
        return subprocess.run(argv, user=self.uid, group=self.gid, extra_groups=[], env=env, **kw)

    def popen(self, argv, **kw) -> subprocess.Popen:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", **kw.pop("env", {})}
        return subprocess.Popen(argv, user=self.uid, group=self.gid, extra_groups=[], env=env, **kw)

    def python(self, code: str, **kw) -> subprocess.CompletedProcess:
        env = {"PYTHONPATH": str(REPO), **kw.pop("env", {})}
        # the system interpreter: the test runner's may live under /root (0700)
        return self.run([SYSTEM_PYTHON, "-c", code], env=env, **kw)


@pytest.fixture(scope="session")
def attacker():
    if os.geteuid() != 0:
        pytest.skip("creating an unprivileged user needs root")
    import pwd

    name = f"sntl-atk{os.getpid() % 100000}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                   check=True, capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        yield Attacker(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_tmp():
    """A root-owned 0755 directory under /tmp that an unprivileged user can reach (pytest's
    tmp_path lives under a 0700 directory)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="sentinel-test-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def register_agent(runtime_dir: Path, pid: int | None = None) -> Path:
    """Record ``pid`` (default: this test process) as the node's torchrun agent, as `sentinel
    launch` does, so that this process and its children count as the job's ranks."""
    from sentinel.procs import AgentRecord, write_agent_record

    runtime_dir.mkdir(parents=True, exist_ok=True)
    pidfile = runtime_dir / "agent.pid"
    write_agent_record(pidfile, AgentRecord.of(pid or os.getpid()))
    return pidfile


@pytest.fixture
def kmsg_writer():
    """Write records to the real kernel log (root); user-space writes unthrottled meanwhile."""
    if os.geteuid() != 0:
        pytest.skip("writing /dev/kmsg needs root")
    knob = Path("/proc/sys/kernel/printk_devkmsg")
    old = knob.read_text().strip()
    knob.write_text("on\n")
    fd = os.open("/dev/kmsg", os.O_WRONLY)

    def write(line: str) -> None:
        os.write(fd, line.encode() + b"\n")

    yield write
    os.close(fd)
    knob.write_text(old + "\n")


# -- the package as a user installs it ---------------------------------------------------------------
@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> Path:
    """The wheel that `pip wheel .` builds from a copy of this checkout (the copy keeps build/ and
    *.egg-info out of the working tree). Built once per session."""
    import shutil

    src = tmp_path_factory.mktemp("src") / "sentinel"
    shutil.copytree(REPO, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".venv", ".pytest_cache",
                                                  ".hypothesis", "out"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("sentinel_gpu-*.whl")
    return wheel


def make_venv(path: Path, *packages: str, python: str = SYSTEM_PYTHON, system_site_packages: bool = False) -> Path:
    """A fresh virtual environment at ``path`` with ``packages`` pip-installed; returns its python."""
    argv = [python, "-m", "venv", str(path)] + (["--system-site-packages"] if system_site_packages else [])
    # the venv must see only what is installed in it: not this checkout through PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stdout}{r.stderr}"
    py = path / "bin" / "python"
    if packages:
        r = subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0, f"pip install {' '.join(packages)}: {r.stdout}{r.stderr}"
    return py
