"""`sentinel drill --scheduler slurm`: the drill through a real Slurm cluster on this machine.

:class:`SlurmCluster` is munged + slurmctld + 4 slurmd (node1..node4) on loopback, each on a free
port, with its own slurm.conf, state and spool directories (several slurmd share one host; see
``SlurmdParameters=config_overrides``). munged is the host's single system daemon: a running one
is used as it is, and one started here is left running (other clusters on the host share it).
Every wait is bounded; the Slurm daemons are stopped by pid.

:class:`SlurmDrill` runs the job as ``deploy/slurm/train.sbatch`` would on a cluster: one
allocation of node1..node3, agents on node1 and node2, node3 the spare, a Sentinel daemon per node
with ``backend = "slurm"``. A fault on node2 must end with node2 DRAINED in ``sinfo -R`` with
Sentinel's reason, the job finished on node1 + node3 with no step lost, a new ``srun -N3
--immediate`` placed on node1, node3, node4, ``sentinel uncordon`` resuming node2, and an admin's
drain (node4) left alone by ``sentinel uncordon``. Root only (slurmd runs the job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from sentinel_tools import drill

NODES = ("node1", "node2", "node3", "node4")



def stop_groups(procs, grace: float) -> None:
    """SIGTERM each process's group (each was started with its own session), wait up to ``grace``
    seconds for all of them together, then SIGKILL the groups still there."""
    procs = list(procs)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)

class SlurmUnavailable(RuntimeError):
    pass


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
    """``nodes``: the slurmd names; ``topology``: a topology.conf for ``TopologyPlugin=topology/tree``
    (None: no topology plugin); ``conf``: an existing cluster's slurm.conf (:meth:`attach`)."""

    def __init__(self, root: Path, conf: Path | None = None, nodes: tuple[str, ...] = NODES,
                 topology: str | None = None) -> None:
        self.root = root
        self.conf = conf or root / "slurm.conf"
        self.nodes = tuple(nodes)
        self.topology = topology
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctld_port, *self.node_ports = drill.free_ports(1 + len(self.nodes))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        d = self.root
        for sub in ("state", "log", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs=2 RealMemory=2000 State=UNKNOWN"
                          for n, p in zip(self.nodes, self.node_ports))
        topology = ""
        if self.topology is not None:
            (d / "topology.conf").write_text(self.topology)
            topology = "TopologyPlugin=topology/tree\n"
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
{topology}{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        ensure_munge()
        self.write_conf()
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env, start_new_session=True,
            stdout=open(self.root / "log" / "slurmctld.out", "ab"), stderr=subprocess.STDOUT)
        self.wait(lambda: self.run("scontrol", "ping").returncode == 0, 30, "slurmctld")
        for n in self.nodes:
            self.procs[n] = subprocess.Popen(
                ["slurmd", "-D", "-N", n, "-f", str(self.conf)], env=self.env, start_new_session=True,
                stdout=open(self.root / "log" / f"slurmd-{n}.out", "ab"), stderr=subprocess.STDOUT)
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", str(len(self.nodes))], 60,
                  f"{len(self.nodes)} idle slurmd nodes")

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
        for n in self.nodes:
            self.run("scontrol", "update", f"nodename={n}", "state=resume")
        self.run("scancel", "--full", "-u", "root")
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", str(len(self.nodes))], 60,
                  "nodes idle again")

    def stop(self) -> None:
        stop_groups(self.procs.values(), grace=10)  # nothing when attached to a running cluster

    @classmethod
    def attach(cls, conf: Path) -> "SlurmCluster":
        """A cluster already running with ``conf`` (its nodes node1..node4): used, never started or stopped."""
        if not conf.is_file():
            raise SlurmUnavailable(f"--slurm-conf {conf}: no such file")
        return cls(conf.parent, conf)


# -- the drill ------------------------------------------------------------------------------------
SBATCH = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "train.sbatch"


class SlurmDrill(drill.Drill):
    """The local drill's job, daemons and report, with Slurm as the scheduler."""

    def __init__(self, args) -> None:
        super().__init__(args)
        conf = args.slurm_conf
        self.attached = conf is not None
        # --topology: a topology.conf (topology/tree) for the cluster started here; the slurm backend
        # reads it back through `scontrol show topology` to pick the spare
        topology = Path(args.topology).read_text() if getattr(args, "topology", None) else None
        self.cluster = SlurmCluster.attach(Path(conf)) if self.attached else SlurmCluster(self.work / "slurm",
                                                                                          topology=topology)
        self.job_id = ""
        self.checks: dict[str, object] = {}
        self.python = getattr(args, "job_python", "") or sys.executable
        self.account = None
        if getattr(args, "user", ""):
            import pwd

            self.account = pwd.getpwnam(args.user)  # KeyError: run_slurm_drill checks first
            # the daemons' directories stay root's; the job writes only into a directory of its user's
            self.work.chmod(0o755)
            self.job_dir = self.work / "job"
            self.job_dir.mkdir()
            os.chown(self.job_dir, self.account.pw_uid, self.account.pw_gid)
            self.progress = self.job_dir / "progress.jsonl"
            self.snapshots = self.job_dir / "snapshots"

    def ready_file(self, node) -> Path:
        return self.job_dir / f"{node.name}-warm.json" if self.account else super().ready_file(node)

    def node_config(self, name: str) -> Path:
        node_root = self.work / name
        (node_root / "run").mkdir(parents=True, exist_ok=True)
        (node_root / "run").chmod(0o755)
        path = node_root / "sentinel.toml"
        path.write_text(
            "[daemon]\npoll_interval_seconds = 0.2\nnvml_deadline_seconds = 1.0\n"
            f'runtime_dir = "{node_root / "run"}"\nstate_dir = "{node_root / "state"}"\nnode_name = "{name}"\n'
            '[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
            "[policy]\nlead_time_seconds = 600.0\ndebounce_samples = 3\n"
            '[actions]\nack_timeout_seconds = 30.0\nbackend = "slurm"\ncommand_timeout_seconds = 10.0\n'
            "[ebpf]\nenabled = false\nkmsg_fallback = false\n")
        return path

    def make_slurm_node(self, name: str, spare: bool):
        from sentinel.sources import simulated

        node = drill.Node(name, self.work / name, spare)
        self.node_config(name)
        simulated.write_state(node.gpus, simulated.healthy_state(self.args.gpus_per_node))
        return node

    def start_daemon(self, node) -> None:
        node.daemon = self.spawn([sys.executable, "-m", "sentinel", "run", "--config", str(node.root / "sentinel.toml"),
                                  "--simulate", str(node.gpus), "--no-ebpf"], node.root / "daemon.log",
                                 env={**self.env, "SLURM_CONF": str(self.cluster.conf)})

    def submit(self) -> None:
        a = self.args
        torchrun = self.agent_argv(self.nodes[0])
        torchrun = torchrun[torchrun.index("--") + 1:]
        env = {**self.env, "SLURM_CONF": str(self.cluster.conf), "TRAIN_NODES": str(a.nodes),
               "SENTINEL": f"{self.python} -m sentinel",
               "SENTINEL_RUNTIME_DIR": str(self.work / "%n" / "run"), "SENTINEL_STATE_DIR": str(self.work / "%n" / "state")}
        nodelist = ",".join(n.name for n in self.nodes)
        as_user: dict = {}
        if self.account is not None:  # submitted by the user, as on a cluster: the job runs as them
            env.update(HOME=str(self.job_dir), USER=self.account.pw_name, LOGNAME=self.account.pw_name)
            as_user = {"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}
        r = subprocess.run(["sbatch", "--parsable", f"--nodes={len(self.nodes)}", f"--nodelist={nodelist}",
                            f"--output={self.job_dir / 'job-%j.out'}", f"--chdir={drill.repo_root()}", str(SBATCH), *torchrun],
                           env=env, capture_output=True, text=True, timeout=60, **as_user)
        if r.returncode != 0:
            raise drill.DrillError(f"sbatch failed: {r.stderr.strip()}")
        self.job_id = r.stdout.strip().split(";")[0]

    def job_state(self) -> str:
        r = self.cluster.run("scontrol", "show", "job", self.job_id, "-o")
        m = re.search(r"JobState=(\S+)", r.stdout)
        return m.group(1) if m else "GONE"

    def run(self) -> dict:
        from sentinel.sources import simulated

        a = self.args
        t_start = time.time()
        if self.attached:
            self.cluster.wait(lambda: self.cluster.run("sinfo", "-h", "-o", "%t %D").stdout.split() == ["idle", str(len(NODES))],
                              30, f"the 4 nodes of {self.cluster.conf} idle")
        else:
            self.cluster.start()
        self.start_store()
        self.nodes = [self.make_slurm_node(f"node{i + 1}", False) for i in range(a.nodes)]
        self.nodes += [self.make_slurm_node(f"node{a.nodes + i + 1}", True) for i in range(a.spares)]
        for n in self.nodes:
            self.start_daemon(n)
        for n in self.nodes:
            self.wait_daemon(n)
        self.submit()
        victim = self.nodes[1] if a.nodes > 1 else self.nodes[0]
        deadline = t_start + a.timeout
        drill.wait(lambda: self.max_step() >= a.at_step or self.job_state() not in ("PENDING", "RUNNING", "CONFIGURING"),
                    deadline - time.time(), f"step {a.at_step} of Slurm job {self.job_id}")
        tl = drill.Timeline(time.time())
        t_fault = time.time()
        simulated.inject(victim.gpus, 0, ["xid=79"])
        tl.add("fault injected", t_fault, node=victim.name, fault="xid79")
        drill.wait(lambda: self.job_state() not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
                    max(1.0, deadline - time.time()), f"Slurm job {self.job_id} to end")
        result = self.report(tl, victim, t_fault)
        result["slurm"] = self.slurm_checks(victim)
        result["ok"] = bool(result["ok"] and all(v is True for k, v in result["slurm"].items() if k.startswith("ok_")))
        return result

    def slurm_checks(self, victim) -> dict:
        c = self.cluster
        out: dict[str, object] = {"job_id": self.job_id, "job_state": self.job_state()}
        job = c.run("scontrol", "show", "job", self.job_id, "-o").stdout
        m = re.search(r"UserId=(\S+)", job)
        out["job_user"] = m.group(1) if m else ""
        if self.account is not None:
            out["ok_job_ran_as_user"] = out["job_user"].startswith(f"{self.account.pw_name}(")
            # the victim's daemon recorded the user's launcher (it could not write the pidfile itself)
            out["victim_registrations"] = _metric(victim, "sentinel_channel_messages_total",
                                                  {"kind": "register", "outcome": "ok"})
            out["ok_agent_registered"] = (out["victim_registrations"] or 0) >= 1
        reasons = c.run("sinfo", "-R", "-h", "-N", "-o", "%N|%T|%E").stdout.splitlines()
        mine = [r for r in reasons if r.startswith(victim.name + "|")]
        out["sinfo_R"] = mine
        out["ok_job_completed"] = out["job_state"] == "COMPLETED"
        out["ok_drained_with_sentinel_reason"] = bool(mine) and "|drained|sentinel: xid gpu0" in mine[0]
        r = c.run("srun", "-N3", "--immediate=20", "bash", "-c", "echo $SLURMD_NODENAME", timeout=60)
        out["new_job_nodes"] = sorted(r.stdout.split())
        out["ok_new_job_avoids_drained"] = r.returncode == 0 and victim.name not in out["new_job_nodes"] \
            and len(out["new_job_nodes"]) == 3
        admin = "node4"
        c.run("scontrol", "update", f"nodename={admin}", "state=drain", "reason=admin: replacing a fan")
        env = {**self.env, "SLURM_CONF": str(c.conf)}
        un_admin = subprocess.run([sys.executable, "-m", "sentinel", "uncordon", "--config", str(self.node_config(admin))],
                                  env=env, capture_output=True, text=True, timeout=60)
        out["uncordon_admin"] = (un_admin.stdout + un_admin.stderr).strip()
        out["ok_admin_drain_left_alone"] = un_admin.returncode == 0 and c.node(admin).get("Reason") == "admin: replacing a fan" \
            and "DRAIN" in c.node(admin).get("State", "")
        un = subprocess.run([sys.executable, "-m", "sentinel", "uncordon", "--config", str(victim.root / "sentinel.toml")],
                            env=env, capture_output=True, text=True, timeout=60)
        out["uncordon"] = (un.stdout + un.stderr).strip()
        state = c.node(victim.name).get("State", "")
        out["ok_uncordon_returns_node"] = un.returncode == 0 and "DRAIN" not in state \
            and not (victim.root / "state" / "cordon.json").exists()
        return out

    def cleanup(self) -> None:
        if self.job_id:
            self.cluster.run("scancel", self.job_id)
        super().cleanup()
        self.cluster.stop()


def _metric(node, name: str, labels: dict[str, str]) -> float | None:
    """One sample from a node daemon's /metrics (None when absent or unreachable)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def run_slurm_drill(args) -> int:
    if getattr(args, "trainer", "reference") != "reference":
        print("sentinel drill: --scheduler slurm runs the reference job only (--trainer reference)", file=sys.stderr)
        return 2
    refused = drill.fault_defaults(args)
    if refused:
        print(f"sentinel drill: {refused}", file=sys.stderr)
        return 2
    if getattr(args, "hosts", "loopback") != "loopback":
        print("sentinel drill: --scheduler slurm runs its nodes on loopback; --hosts netns is not wired to it yet",
              file=sys.stderr)
        return 2
    why = missing()
    if why:
        print(f"sentinel drill --scheduler slurm: needs {why}", file=sys.stderr)
        return 2
    if getattr(args, "user", ""):
        import pwd

        try:
            pw = pwd.getpwnam(args.user)
        except KeyError:
            print(f"sentinel drill: --user {args.user}: no such user", file=sys.stderr)
            return 2
        python = getattr(args, "job_python", "") or sys.executable
        try:
            r = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, timeout=120, cwd="/",
                               user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], env={**os.environ, "HOME": "/"})
        except OSError as exc:
            r = subprocess.CompletedProcess([python], 127, "", str(exc))
        if r.returncode != 0:
            print(f"sentinel drill: --user {args.user} cannot run {python} with torch ({r.stderr.strip()[-300:]}); "
                  f"pass --job-python with an interpreter that user can run", file=sys.stderr)
            return 2
    if args.nodes + args.spares > len(NODES) - 1:
        print(f"sentinel drill --scheduler slurm: --nodes + --spares must leave one of the {len(NODES)} Slurm nodes free "
              f"(the new job and the admin's drain use it)", file=sys.stderr)
        return 2
    if args.slurm_conf is not None and not Path(args.slurm_conf).is_file():
        print(f"sentinel drill --scheduler slurm: --slurm-conf {args.slurm_conf}: no such file", file=sys.stderr)
        return 2
    d = SlurmDrill(args)
    try:
        result = d.run()
    except (drill.DrillError, SlurmUnavailable) as exc:
        print(f"sentinel drill: {exc}; logs in {d.work}", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        d.cleanup()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        drill.print_timeline(result)
        for k, v in result["slurm"].items():
            print(f"slurm: {k}: {v}")
    return 0 if result["ok"] else 1
