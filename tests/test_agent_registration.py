"""Agent registration over register.sock, as an unprivileged user would try it: the daemon records a
launcher only when the kernel-verified sender is a job process (here: in a pod's kubepods cgroup,
in a pid namespace of its own), under its host pid; any other local process is refused, and a
message cannot name another pid."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import REPO, SYSTEM_PYTHON, metric_value, wait_for
from sentinel import procs

# what `sentinel launch` does when it cannot write the pidfile: register, then wait for "go" to exit
CLIENT = """
import os, sys, time
from pathlib import Path
from sentinel import channel
run, gate = Path(sys.argv[1]), Path(sys.argv[2])
Path(sys.argv[3]).write_text(str(os.getpid()))
while not (gate / "register").exists():
    time.sleep(0.05)
channel.register(run)
while not (gate / "exit").exists():
    time.sleep(0.05)
"""


@pytest.fixture
def kubepods_cgroup():
    """A cgroup whose path says kubepods, as the container runtime makes for a pod (cgroup v1 pids
    hierarchy, or the unified one)."""
    for top in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (top / "cgroup.procs").exists():
            break
    else:
        pytest.skip("no writable cgroup hierarchy")
    path = Path(tempfile.mkdtemp(prefix="kubepods-sentinel-test-", dir=top))
    yield path
    for _ in range(50):  # empty once the test's processes exited
        try:
            path.rmdir()
            break
        except OSError:
            import time

            time.sleep(0.1)


def client(attacker, shared_tmp, name, *, pidns: bool):
    gate = shared_tmp / name
    gate.mkdir()
    os.chmod(gate, 0o777)
    pidfile = gate / "pid"
    argv = [SYSTEM_PYTHON, "-c", CLIENT, str(shared_tmp / "run"), str(gate), str(pidfile)]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    if pidns:  # a pod: its own pid namespace and /proc, then the unprivileged user
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--", "setpriv", f"--reuid={attacker.uid}",
                f"--regid={attacker.gid}", "--clear-groups", *argv]
        proc = subprocess.Popen(argv, env=env)
    else:
        proc = attacker.popen(argv, env=env)
    # exists() can be seen before write_text's data: wait for the pid itself
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=30, what=f"{name} to start")
    ns_pid = int(pidfile.read_text())
    host = procs.host_pid(ns_pid, procs.pid_namespace(_child(proc.pid))) if pidns else ns_pid
    return proc, gate, ns_pid, host


def _child(pid: int) -> int:
    """unshare --fork's child (pid 1 of the new namespace)."""
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


def test_only_a_job_process_is_recorded_under_its_host_pid(sim_state, start_daemon, shared_tmp, attacker,
                                                           kubepods_cgroup):
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("needs unshare and setpriv (util-linux)")
    d = start_daemon("--simulate", str(sim_state), runtime_dir=shared_tmp / "run")
    pidfile = shared_tmp / "run" / "agent.pid"

    # a local user's process that is no job's: refused, nothing recorded
    stranger, gate, _, pid = client(attacker, shared_tmp, "stranger", pidns=False)
    (gate / "register").write_text("")
    wait_for(lambda: metric_value(d.scrape(), "sentinel_channel_messages_total", kind="register",
                                  outcome="refused_not_a_job") == 1, timeout=20, what="the refusal")
    assert not pidfile.exists()
    assert "not a task of a Slurm job step" in d.log() and "not in a Kubernetes pod's cgroup" in d.log()
    (gate / "exit").write_text("")
    stranger.wait(timeout=20)

    # a message cannot name a pid: only the kernel's counts, and extra fields make it malformed
    r = attacker.python("import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
                        f"s.sendto(b'{{\"type\":\"register\",\"version\":1,\"pid\":{os.getpid()}}}', "
                        f"{str(shared_tmp / 'run' / 'register.sock')!r})")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: metric_value(d.scrape(), "sentinel_channel_messages_total", kind="register", outcome="malformed") == 1,
             timeout=20, what="the malformed message counted")
    assert not pidfile.exists()

    # a pod's launcher: its own pid namespace, not root, in a kubepods cgroup -> recorded, host pid
    pod, gate, ns_pid, host = client(attacker, shared_tmp, "pod", pidns=True)
    try:
        assert host is not None and host != ns_pid
        (kubepods_cgroup / "cgroup.procs").write_text(str(host))
        (gate / "register").write_text("")
        wait_for(pidfile.exists, timeout=20, what="the daemon's record")
        assert os.stat(pidfile).st_uid == 0
        record = procs.read_agent_record(pidfile)
        assert (record.pid, record.uid) == (host, attacker.uid)
        written = json.loads(pidfile.read_text().splitlines()[1])
        assert written["pid"] == host and written["pidns"] == procs.pid_namespace()
        # the record is written before the counters are next published: wait for them, no order assumed
        wait_for(lambda: metric_value(d.scrape(), "sentinel_channel_messages_total", kind="register", outcome="ok") == 1,
                 timeout=20, what="the registration counted")
    finally:
        (gate / "exit").write_text("")
        pod.wait(timeout=20)


def test_an_ordinary_users_launcher_refuses_to_start_on_a_node_the_daemon_cordoned(sim_state, start_daemon, shared_tmp,
                                                                                   attacker):
    """It cannot read the daemon's 0750 state directory; the running daemon's status says the node is cordoned."""
    state = shared_tmp / "state"
    d = start_daemon("--simulate", str(sim_state), "--state-dir", str(state), runtime_dir=shared_tmp / "run")
    job = shared_tmp / "job"
    job.mkdir()
    os.chown(job, attacker.uid, attacker.gid)
    marker = job / "ran"

    def launch():
        return attacker.run([SYSTEM_PYTHON, "-m", "sentinel", "launch", "--pidfile", str(shared_tmp / "run" / "agent.pid"),
                             "--state-dir", str(state), "--", "/usr/bin/touch", str(marker)],
                            env={"PYTHONPATH": str(REPO), "SENTINEL_RUNTIME_DIR": str(shared_tmp / "run")})

    r = launch()  # not cordoned: it runs (and, not being a job's process, is not recorded)
    assert r.returncode == 0 and marker.exists(), r.stderr
    marker.unlink()
    from sentinel.sources import simulated

    simulated.inject(sim_state, 0, ["xid=79"])
    wait_for(lambda: d.status["cordoned"], timeout=30, what="the node cordoned")
    r = launch()
    assert r.returncode == 3 and "node is cordoned" in r.stderr and "xid" in r.stderr
    assert not marker.exists()
