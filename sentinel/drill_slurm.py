"""A real Slurm cluster on loopback for tests: munged + slurmctld + 4 slurmd (node1..node4), each
on a free port, with its own slurm.conf, state and spool directories under a temporary directory
(see /work/shared/REAL_COMPONENTS.md). munged is the host's single system daemon: an already
running one is used as it is, and one started here is left running (other clusters on this
host share it). Every wait is bounded; the Slurm daemons are stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("node1", "node2", "node3", "node4")


class SlurmUnavailable(RuntimeError):
    pass


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def missing() -> str:
    """What this machine lacks to run the cluster ("" when nothing)."""
    for prog in ("slurmctld", "slurmd", "scontrol", "sinfo", "srun", "sbatch", "munged"):
        if shutil.which(prog) is None and not Path(f"/usr/sbin/{prog}").exists():
            return f"{prog} (Debian packages slurm-wlm, munge; scripts/setup installs them)"
    if os.geteuid() != 0:
        return "root (slurmd runs jobs as their users)"
    return ""


def ensure_munge() -> None:
    def works() -> bool:
        try:
            cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
            return cred.returncode == 0 and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                                                           timeout=5).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    if works():
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, timeout=10)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if works():
            return
        time.sleep(0.1)
    raise SlurmUnavailable("munged did not start (runuser -u munge -- /usr/sbin/munged)")


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctld_port, *self.node_ports = free_ports(1 + len(NODES))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        d = self.root
        for sub in ("state", "log", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=2000 State=UNKNOWN"
                          for n, p in zip(NODES, self.node_ports))
        self.conf.write_text(f"""ClusterName=sentinel
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=1
MpiDefault=none
SwitchType=switch/none
SlurmdTimeout=30
KillWait=5
MessageTimeout=10
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        ensure_munge()
        self.write_conf()
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env, start_new_session=True,
            stdout=open(self.root / "log" / "slurmctld.out", "ab"), stderr=subprocess.STDOUT)
        self.wait(lambda: self.run("scontrol", "ping").returncode == 0, 30, "slurmctld")
        for n in NODES:
            self.procs[n] = subprocess.Popen(
                ["slurmd", "-D", "-N", n, "-f", str(self.conf)], env=self.env, start_new_session=True,
                stdout=open(self.root / "log" / f"slurmd-{n}.out", "ab"), stderr=subprocess.STDOUT)
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", str(len(NODES))], 60,
                  "4 idle slurmd nodes")

    def run(self, *argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, **kw)

    def wait(self, predicate, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({p.returncode}): {self.logs()}")
            try:
                if predicate():
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            try:
                out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-1500:])
            except OSError:
                pass
        return "\n".join(out)

    def node(self, name: str) -> dict[str, str]:
        """`scontrol show node` as a dict (Reason keeps its spaces)."""
        from sentinel.backends.slurm import parse_node

        return parse_node(self.run("scontrol", "show", "node", name, "-o").stdout)

    def reset_nodes(self) -> None:
        """Every node back to idle (tests leave drains behind on purpose)."""
        for n in NODES:
            self.run("scontrol", "update", f"nodename={n}", "state=resume")
        self.run("scancel", "--full", "-u", "root")
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", str(len(NODES))], 60,
                  "nodes idle again")

    def stop(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
