"""`sentinel drill`: the whole path on one machine, no GPU.

A rendezvous store (a c10d TCPStore, or etcd with ``--rdzv-backend etcd-v2``), N "nodes" — each
a Sentinel daemon with its own simulated GPUs, runtime and state directories and metrics port,
plus an elastic agent running ``trainer/train.py`` — and S spare nodes. With ``--agent warm``
(the default) every agent is ``python -m trainer.elastic`` under ``sentinel launch``, and a spare's
agent is started at once with ``--warm``: torch and the training module imported, forkserver up,
*outside* the rendezvous until the migration admits it (``sentinel admit``: a spare inside the
rendezvous plus any rank crash starts an endless 3-nodes-for-2-slots re-rendezvous loop). With
``--agent torchrun`` the agents are plain torchrun and spares are cold (the agent starts only
when a migration begins): the "before" of ``bench/migration.py``. A fault is
injected at step K into one node's simulated GPU; the timeline of every stage is printed; the
exit status is 0 only when the job finished with a spare in place of the failed node and no
step was lost (``--verify`` also compares the final parameters bitwise with an uninterrupted
run).

This module never imports torch: the job runs in torchrun subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sentinel.procs import running
from sentinel_tools.drill_verdict import job_health
from sentinel.sources import simulated

FAULTS = {
    "xid79": "Xid 79 (GPU fell off the bus) on one GPU",
    "dbe": "a double-bit (uncorrectable) ECC error",
    "sbe-ramp": "single-bit errors retiring pages at a rate only the trend predictor catches",
    "kill": "sudden failure: kill -9 of the node's agent and workers, no warning",
    "rank-crash": "kill -9 of one training rank, agent alive (the spare stays cold; workers restart in place)",
    "hang": "a hung collective: one rank SIGSTOPped (--hang-mode stop) or never entering the collective (skip)",
    "slow": "a straggler: the node's ranks compute --slow-factor times slower, its GPU 0 reports a hardware slowdown",
}


def cached_reference(cache: Path, world: int, steps: int, run) -> tuple[dict[str, Any] | None, str]:
    """``--reference-cache``: the uninterrupted run's final state for this world size, step count
    and trainer code (a digest of ``trainer/``'s sources), made by ``run(directory)`` once and
    reused by every later drill that verifies the same job; drills running at once wait for the
    first (a file lock). A failed run is not kept."""
    import fcntl
    import hashlib

    code = hashlib.sha256()
    for src in sorted((repo_root() / "trainer").rglob("*.py")):
        code.update(src.relative_to(repo_root()).as_posix().encode() + b"\0" + src.read_bytes())
    key = f"world{world}-steps{steps}-{code.hexdigest()[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    kept = cache / f"{key}.json"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if kept.exists():
            return json.loads(kept.read_text()), ""
        work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache))
        try:
            want, error = run(work)
            if want is not None:
                tmp = cache / f"{key}.json.tmp"
                tmp.write_text(json.dumps(want))
                os.replace(tmp, kept)
            return want, error
        finally:
            shutil.rmtree(work, ignore_errors=True)


def alive(pid: int) -> bool:
    """``pid`` runs (a dead spare must be noticed while it is a zombie): :func:`sentinel.procs.running`."""
    return running(pid)


SPARE_CALL_WAIT_SECONDS = 30.0
PORT_RESERVATIONS = Path(tempfile.gettempdir()) / "sentinel-port-reservations"
PORT_RESERVATION_SECONDS = 300.0


def _reserve(port: int, now: float) -> bool:
    """Claim ``port`` for this host's pickers for PORT_RESERVATION_SECONDS (a file per port, made
    with O_EXCL; an older claim is stale). Two pickers in different processes or suites can then
    never hand out the same port while the first one's server is still starting. True when
    claimed, or when the directory cannot be used (another user's: the pick stays random)."""
    try:
        PORT_RESERVATIONS.mkdir(mode=0o1777, exist_ok=True)
    except OSError:
        return True
    path = PORT_RESERVATIONS / str(port)
    try:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            if now - path.lstat().st_mtime < PORT_RESERVATION_SECONDS:
                return False
            path.unlink()
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
        os.close(fd)
        return True
    except FileExistsError:  # another picker re-claimed the stale one first
        return False
    except OSError:
        return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports for servers started later (a store, etcd, slurmctld and
    slurmd), picked at random *below* the kernel's ephemeral range: a port from ``bind(0)`` is
    free only until the kernel hands it to some other bind(0) or outgoing connection, and a
    second suite on the host once took a slurmd's that way (EADDRINUSE). Each pick is also
    reserved host-wide for a few minutes (:func:`_reserve`): a random pick in another xdist worker
    once gave the kube test cluster's etcd a port another picker had just handed out. Falls back
    to bind(0) when the range leaves no room below it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    socks: list[socket.socket] = []
    try:
        for attempt in range(200 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randint(10000, low - 1) if low > 11000 else 0))
            except OSError:
                s.close()
                continue
            # the reservations are advisory: after many refusals (a full directory), take the port
            if low > 11000 and attempt < 100 * n and not _reserve(s.getsockname()[1], time.time()):
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise OSError(f"no {n} free ports below {low}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class Node:
    name: str
    root: Path
    spare: bool
    daemon: subprocess.Popen | None = None
    agent: subprocess.Popen | None = None
    metrics_port: int | None = None

    @property
    def runtime(self) -> Path:
        return self.root / "run"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def gpus(self) -> Path:
        return self.root / "gpus.json"

    @property
    def pidfile(self) -> Path:
        return self.runtime / "agent.pid"


@dataclass
class Timeline:
    t0: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, stage: str, at: float | None, **info: Any) -> None:
        if at is not None:
            self.events.append({"stage": stage, "time": at, "t": round(at - self.t0, 3), **info})


class Drill:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.own_workdir = args.workdir is None
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="sentinel-drill-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.job_dir = self.work  # where the job itself writes (its progress, snapshots, final parameters)
        self.python = sys.executable  # the job's interpreter
        self.progress = self.job_dir / "progress.jsonl"
        self.snapshots = self.job_dir / "snapshots"
        self.pool = self.work / "spare-pool"
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[Node] = []
        self.store_port = free_port()
        self.spare_notes: list[str] = []
        self.spare_killed = False
        self.spare_pids: dict[str, int] = {}  # spare node -> the agent pid its pidfile named
        self.filler: Path | None = None
        self.mounted = False
        self.run_id = f"drill-{os.getpid()}"
        self.victim_names: set[str] = set()  # set by run(): the nodes it faults
        # Each node's memory-tier holder: a tmpfs directory of its own ("node memory").
        self.memory_root = Path("/dev/shm") / f"sentinel-drill-{os.getpid()}-{os.urandom(3).hex()}"
        # plain torchrun keeps the first round's worker-store address for good (a spare deadlocks
        # waiting for MASTER_ADDR): its rank-0 worker hosts the store instead; trainer.elastic
        # forgets the address every round, and its rank-0 agent hosts the store (README)
        # TORCH_FR_BUFFER_SIZE: torch's flight recorder (gloo too), from which the guard tells a
        # rank's compute from its waiting (docs/hangs-and-stragglers.md); 64 entries hold a
        # progress window of this job's collectives and keep a dump cheap
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(),
                    "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "64")}
        if args.agent == "torchrun":
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        else:
            self.env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)

    # -- processes -------------------------------------------------------------------------------
    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None, session: bool = True) -> subprocess.Popen:
        with open(log, "a") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or self.env,
                                 start_new_session=session, cwd=str(repo_root()))
        self.procs.append(p)
        return p

    def start_store(self) -> None:
        if self.args.rdzv_backend == "etcd-v2":
            etcd = shutil.which("etcd")
            if etcd is None:
                raise DrillError("--rdzv-backend etcd-v2 needs etcd (Debian package etcd-server)")
            import importlib.util

            if importlib.util.find_spec("etcd") is None:
                raise DrillError("--rdzv-backend etcd-v2 needs the python-etcd package: pip install python-etcd==0.4.5")
            peer = free_port()
            url, peer_url = f"http://127.0.0.1:{self.store_port}", f"http://127.0.0.1:{peer}"
            self.spawn([etcd, "--name", "drill", "--data-dir", str(self.work / "etcd"), "--enable-v2=true",
                        "--listen-client-urls", url, "--advertise-client-urls", url, "--listen-peer-urls", peer_url,
                        "--initial-advertise-peer-urls", peer_url, "--initial-cluster", f"drill={peer_url}",
                        "--log-level", "warn"], self.work / "store.log")
        else:
            self.spawn([sys.executable, "-m", "trainer.store", "--port", str(self.store_port)], self.work / "store.log")
        # a third of the drill's --timeout, at least 30 s: the store's torch import took over 30 s
        # on a 2-core host running two test suites
        wait(lambda: _port_open(self.store_port), max(30.0, self.args.timeout / 3), "rendezvous store")

    def agent_argv(self, node: Node) -> list[str]:
        a = self.args
        nnodes = f"{a.min_nodes or a.nodes}:{a.nodes}"
        # etcd-v2 is torch's dynamic rendezvous (as c10d) with its state in etcd: the same settings
        rdzv_conf = ("protocol=http," if a.rdzv_backend == "etcd-v2" else "is_host=false,") + (
            f"keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout={int(a.timeout)}")
        py = self.python
        launch = [py, "-m", "sentinel", "launch", "--pidfile", str(node.pidfile), "--state-dir", str(node.state_dir)]
        if a.agent == "warm":
            launch += ["--warm"] if node.spare else []
            agent = [py, "-m", "trainer.elastic", "--preload", "trainer.train",
                     "--ready-file", str(self.ready_file(node)), "--"]
        else:
            agent = [py, "-m", "torch.distributed.run", f"--start-method={a.start_method}"]
        return [
            *launch, "--", *agent, f"--nnodes={nnodes}", f"--nproc-per-node={a.procs_per_node}",
            f"--rdzv-backend={a.rdzv_backend}", f"--rdzv-endpoint=127.0.0.1:{self.store_port}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={rdzv_conf}", f"--max-restarts={a.max_restarts}", "--monitor-interval=0.1",
            "-m", "trainer.train", "--steps", str(a.steps), "--snapshot-dir", str(self.snapshots),
            "--interval-steps", str(a.interval_steps), "--step-seconds", str(a.step_seconds),
            "--progress", str(self.progress), "--final", str(self.job_dir / "final.json"),
            # a hang drill waits for the hang watch (T >= 30 s by default), not the process-group timeout
            "--migrate-hold-seconds", "30", "--pg-timeout", "300" if a.fault == "hang" else "30",
            "--memory-interval-steps", str(a.memory_interval_steps), "--migrate-ack", a.migrate_ack,
        ]

    def ready_file(self, node: Node) -> Path:
        """Where a warm agent says it is warm."""
        return node.runtime / "warm.json"

    def node_env(self, node: Node) -> dict[str, str]:
        env = {**self.env, "SENTINEL_RUNTIME_DIR": str(node.runtime), "SENTINEL_NODE": node.name,
               "SENTINEL_DRILL_FAULT_FILE": str(node.runtime / "drill-fault"),
               "SENTINEL_MEMORY_DIR": str(self.memory_root / node.name)}
        if self.args.topology:  # the memory tier places each replica outside its holder's rack
            env["SENTINEL_TOPOLOGY"] = str(self.args.topology)
        return env

    def make_node(self, index: int, spare: bool) -> Node:
        name = f"spare{index}" if spare else f"node{index}"
        node = Node(name, self.work / name, spare)
        node.runtime.mkdir(parents=True)
        node.runtime.chmod(0o755)
        simulated.write_state(node.gpus, simulated.healthy_state(self.args.gpus_per_node))
        spare_cmd = json.dumps(self.claim_argv("{node}"))
        topology = f'[actions.topology]\nfile = {json.dumps(str(self.args.topology))}\n' if self.args.topology else ""
        (node.root / "sentinel.toml").write_text(
            "[daemon]\npoll_interval_seconds = 0.2\nnvml_deadline_seconds = 1.0\n"
            f'runtime_dir = "{node.runtime}"\nstate_dir = "{node.state_dir}"\nnode_name = "{name}"\n'
            'log_level = "info"\n'
            '[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
            "[policy]\nlead_time_seconds = 600.0\ndebounce_samples = 3\n"
            f"[actions]\nack_timeout_seconds = 30.0\nbackend = \"command\"\nspare_command = {spare_cmd}\n"
            f"[job]\nhandover_seconds = {self.args.handover_seconds}\n"
            "[ebpf]\nenabled = false\nkmsg_fallback = false\n"  # drills must not react to the host's kernel log
            + topology
        )
        if spare:
            self.pool.mkdir(exist_ok=True)
            (self.pool / f"{name}.json").write_text(json.dumps({
                "name": name, "argv": self.agent_argv(node), "env": self.node_env(node),
                "log": str(node.root / "agent.log"), "cwd": str(repo_root()),
                "warm": self.args.agent == "warm", "pidfile": str(node.pidfile),
            }))
            (self.pool / f"{name}.free").write_text("")
        return node

    def claim_argv(self, departed: str) -> list[str]:
        """The spare command: with --topology, the free spare nearest ``departed``."""
        argv = [sys.executable, "-m", "sentinel_tools.drill", "claim-spare", "--pool", str(self.pool)]
        if self.args.topology:
            argv += ["--for", departed, "--topology", str(self.args.topology)]
        return argv

    def start_daemon(self, node: Node) -> None:
        node.daemon = self.spawn([sys.executable, "-m", "sentinel", "run", "--config", str(node.root / "sentinel.toml"),
                                  "--simulate", str(node.gpus), "--no-ebpf"], node.root / "daemon.log")

    def wait_daemon(self, node: Node) -> None:
        status = node.runtime / "status.json"
        wait(lambda: status.exists() or (node.daemon and node.daemon.poll() is not None), max(60.0, self.args.timeout / 3),
             f"{node.name} daemon")
        if node.daemon and node.daemon.poll() is not None:
            raise DrillError(f"{node.name}'s daemon exited: {(node.root / 'daemon.log').read_text()[-1500:]}")
        node.metrics_port = json.loads(status.read_text())["metrics_port"]

    def start_agent(self, node: Node) -> None:
        node.agent = self.spawn(self.agent_argv(node), node.root / "agent.log", env=self.node_env(node))

    # -- the drill -------------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        if not self.progress.exists():
            return []
        out = []
        for line in self.progress.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line still being written
        return out

    def max_step(self) -> int:
        return max((e["step"] for e in self.events() if e["event"] == "step"), default=-1)

    def inject(self, victim: Node) -> float:
        fault = self.args.fault
        t = time.time()
        if fault == "xid79":
            simulated.inject(victim.gpus, 0, ["xid=79"])
        elif fault == "dbe":
            simulated.inject(victim.gpus, 0, ["ecc-dbe=+1"])
        elif fault == "sbe-ramp":
            simulated.inject(victim.gpus, 0, ["retired-sbe=+40"])
        elif fault == "kill" and victim.agent is not None:
            for pid in [victim.agent.pid, *descendants(victim.agent.pid)]:  # agent and workers, no warning
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(self.memory_root / victim.name, ignore_errors=True)  # the node's memory died with it
        elif fault == "hang" and victim.agent is not None:
            if self.args.hang_mode == "skip":
                (victim.runtime / "drill-fault").write_text("skip")
            else:
                ranks = self._ranks_of(victim)
                if ranks:
                    os.kill(ranks[0], signal.SIGSTOP)
        elif fault == "slow":
            (victim.runtime / "drill-fault").write_text(f"slow={self.args.slow_factor}")
            simulated.inject(victim.gpus, 0, ["set=throttle_reasons:8"])  # NVML clocks event: HW slowdown
        elif fault == "rank-crash" and victim.agent is not None:
            # a rank of this node, by the pid it logged: argv cannot tell a rank from its agent (a
            # warm agent's and its forkserver's argv name the training module too)
            below = set(descendants(victim.agent.pid))
            ranks = [e["pid"] for e in reversed(self.events())
                     if e["event"] == "admitted" and e["node"] == victim.name and e.get("pid") in below]
            if ranks:
                os.kill(ranks[0], signal.SIGKILL)
        return t

    def _ranks_of(self, victim: Node) -> list[int]:
        below = set(descendants(victim.agent.pid)) if victim.agent is not None else set()
        return [e["pid"] for e in reversed(self.events())
                if e["event"] == "admitted" and e["node"] == victim.name and e.get("pid") in below]

    def ramp(self, victim: Node, until: float) -> None:
        """sbe-ramp: one more page retired every 0.3 s — a trend, not a jump."""
        while time.time() < until and not (victim.state_dir / "cordon.json").exists():
            simulated.inject(victim.gpus, 0, ["retired-sbe=+1"])
            time.sleep(0.3)

    def fill_disk(self) -> None:
        """--fail-snapshot: fill the snapshot filesystem so the migrate snapshot hits ENOSPC."""
        filler = self.snapshots / "filler"
        with open(filler, "wb") as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
        self.filler = filler

    def run(self) -> dict[str, Any]:
        a = self.args
        t_start = time.time()
        if a.fail_snapshot:
            # A small filesystem of its own, so "disk full" is real and hurts nothing else.
            self.snapshots.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "sentinel-drill", str(self.snapshots)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise DrillError(f"--fail-snapshot needs root to mount a small tmpfs: {r.stderr.strip()}")
            self.mounted = True
        progress(f"starting {a.nodes} node(s) and {a.spares} spare(s) in {self.work}")
        self.start_store()
        self.nodes = [self.make_node(i, False) for i in range(a.nodes)] + [self.make_node(i, True) for i in range(a.spares)]
        for n in self.nodes:
            self.start_daemon(n)
        for n in self.nodes:
            self.wait_daemon(n)
        for n in self.nodes:
            if not n.spare or a.agent == "warm":  # warm spares start now and wait outside the rendezvous
                self.start_agent(n)
        if a.agent == "warm":
            for n in (n for n in self.nodes if n.spare):
                ready, agent = self.ready_file(n), n.agent
                wait(lambda: ready.exists() or agent.poll() is not None, max(1.0, t_start + a.timeout - time.time()),
                      f"{n.name}'s agent to be warm")
                if agent.poll() is not None:
                    raise DrillError(f"{n.name}'s agent exited before it was warm: "
                                     f"{(n.root / 'agent.log').read_text()[-1500:]}")
        victims = self.nodes[1:1 + a.victims] if a.nodes > a.victims else self.nodes[:a.victims]
        victim = victims[0]
        self.victim_names = {v.name for v in victims}
        deadline = t_start + a.timeout
        wait(lambda: self.max_step() >= a.at_step or self._job_dead(), deadline - time.time(), f"step {a.at_step}")
        tl = Timeline(time.time())
        if a.fail_snapshot:
            self.fill_disk()
        for v in victims:  # several nodes at once: each daemon migrates its own node
            t_fault = self.inject(v)
            tl.add("fault injected", t_fault, node=v.name, fault=a.fault)
            progress(f"fault {a.fault} injected into {v.name}")
        t_fault = tl.events[0]["time"]
        if a.fault == "sbe-ramp":
            self.ramp(victim, min(deadline, time.time() + 30))
        if a.fault == "kill":
            # The nodes died with their daemons' help unavailable: the scheduler replaces them.
            for v in victims:
                subprocess.run(self.claim_argv(v.name), env=self.env, check=False, timeout=30, capture_output=True)
        short = a.spares < a.victims and a.fault != "rank-crash"
        what = "the job to finish"
        if short and (a.min_nodes or a.nodes) >= a.nodes:
            what += (f" (no spare left for {a.victims} failed node(s) and --nnodes {a.nodes}:{a.nodes} does not allow"
                     " fewer: the job is waiting for a node; allow it with --min-nodes)")
        def done() -> bool:
            events = self.events()  # one read of the progress log per check
            self._watch_spares(t_fault, events)
            if self.filler is not None and self._migration(victim).get("phase") == "drained":
                self.filler.unlink(missing_ok=True)  # the operator frees space; later snapshots succeed
                self.filler = None
            return any(e["event"] == "finished" for e in events) or self._job_dead()

        end = deadline
        if "waiting for a node" in what:  # nothing will come: say so after a bounded look, not at the deadline
            end = min(deadline, time.time() + NO_NODE_WAIT_SECONDS)
        wait(done, max(1.0, end - time.time()), what)
        self._wait_spare_calls(victims, deadline)
        result = self.report(tl, victim, t_fault)
        if self.spare_notes:
            result.setdefault("notes", []).extend(self.spare_notes)
        if len(victims) > 1:
            others = [self._migration(v) for v in victims[1:]]
            result["other_failed_nodes"] = [v.name for v in victims[1:]]
            result["other_migrations"] = [{"node": v.name, "phase": m.get("phase"), "snapshot_step": m.get("snapshot_step")}
                                          for v, m in zip(victims[1:], others)]
            # a sudden kill has no migration: the scheduler replaced the nodes
            drained = a.fault == "kill" or all(m.get("phase") == "drained" for m in others)
            result["final_nodes_ok"] = not set(result["final_nodes"]) & {v.name for v in victims}
            result["ok"] = result["ok"] and drained and result["final_nodes_ok"]
        return result

    def _wait_spare_calls(self, victims: list[Node], deadline: float) -> None:
        """The daemon asks for a spare without waiting for it (the spare warms while the snapshot is
        written) and records the answer (``spare``, ``times.spare_chosen``) when the call returns:
        on a loaded host the job can finish first. Wait, bounded, until every victim's migration
        has its answer (``times.spare_called``), so the report never reads a half-written record."""
        def answered() -> bool:
            records = [self._migration(v) for v in victims]
            return all("spare_called" in r.get("times", {}) for r in records if "requested" in r.get("times", {}))
        if answered():
            return
        try:
            wait(answered, max(1.0, min(SPARE_CALL_WAIT_SECONDS, deadline - time.time())), "the spare calls' answers")
        except DrillError:
            pass  # reported as it stands: the timeline shows no "spare chosen"

    def _migration(self, node: Node) -> dict[str, Any]:
        try:
            return json.loads((node.state_dir / "migration.json").read_text())
        except (OSError, ValueError):
            return {}

    def _watch_spares(self, t_fault: float, events: list[dict[str, Any]]) -> None:
        """The scheduler's part: a claimed spare whose agent died before it was admitted is
        replaced by the next free one. With --kill-spare, the first claimed spare is killed."""
        admitted = {e["node"] for e in events if e["event"] == "admitted" and e["time"] >= t_fault}
        for n in self.nodes:
            if not n.spare or not (self.pool / f"{n.name}.claimed").exists() or n.name in admitted:
                continue
            try:
                pid = int(n.pidfile.read_text().split()[0])
                self.spare_pids[n.name] = pid
            except (OSError, ValueError, IndexError):
                # still starting — or its agent died and `sentinel launch` removed the pidfile
                pid = self.spare_pids.get(n.name, 0)
                if not pid:
                    continue
            if self.args.kill_spare and not self.spare_killed:
                self.spare_killed = True
                for victim_pid in [pid, *descendants(pid)]:
                    try:
                        os.kill(victim_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                gone_by = time.monotonic() + 10  # SIGKILL is delivered asynchronously: see it dead before going on
                while alive(pid) and time.monotonic() < gone_by:
                    time.sleep(0.02)
            if not alive(pid) and not (self.pool / f"{n.name}.dead").exists():
                (self.pool / f"{n.name}.dead").write_text("")
                r = subprocess.run(self.claim_argv(next(iter(sorted(self.victim_names)), "")),
                                   env=self.env, check=False, timeout=30, capture_output=True, text=True)
                self.spare_notes.append(f"spare {n.name} died during the migration; "
                                        + (r.stdout.strip() or r.stderr.strip() or "no replacement"))

    def _job_dead(self) -> bool:
        agents = [n.agent for n in self.nodes if n.agent is not None]
        claimed = [n for n in self.nodes if n.spare and (self.pool / f"{n.name}.claimed").exists()
                   and not (self.pool / f"{n.name}.dead").exists()]
        return bool(agents) and all(p.poll() is not None for p in agents) and not claimed

    def report(self, tl: Timeline, victim: Node, t_fault: float) -> dict[str, Any]:
        events = self.events()
        mig = self._migration(victim)
        times = mig.get("times", {})
        tl.add("detected", times.get("tripped"), rule=mig.get("rule"), reason=mig.get("reason"))
        tl.add("snapshot requested", times.get("requested"))
        tl.add("snapshot committed", times.get("acknowledged"), step=mig.get("snapshot_step"), ok=mig.get("snapshot_ok"))
        tl.add("node cordoned", times.get("cordoned"))
        tl.add("agent stopped", times.get("drained"))
        spare = mig.get("spare") or {}
        tl.add("spare chosen", times.get("spare_chosen"), node=spare.get("node"), distance=spare.get("distance"),
               why=spare.get("why"))
        spares = {n.name for n in self.nodes if n.spare}
        admitted = [e for e in events if e["event"] == "admitted" and e["node"] in spares and e["time"] >= t_fault]
        loaded = [e for e in events if e["event"] == "resumed" and e["node"] in spares and e["time"] >= t_fault]
        if not loaded:  # no spare joined: the job went on with the nodes it had (or did not resume at all)
            loaded = [e for e in events if e["event"] == "resumed" and e["time"] >= t_fault]
        # the survivors' ranks: the victims' own ranks leave their hold too, at their drain
        victims = self.victim_names or {victim.name}
        left = [e for e in events if e["event"] == "drained" and e["time"] >= t_fault and e["node"] not in victims]
        tl.add("survivors left the hold", min((e["time"] for e in left), default=None))
        # each worker's own time.time() at its start (trainer.train stamps it before importing torch):
        # the same clock as every other event, never /proc's start time (whole-second boot time)
        started = [e.get("process_started") for e in admitted if e.get("process_started")]
        tl.add("spare workers started", min(started, default=None), warm=self.args.agent == "warm")
        t_admit = min((e["time"] for e in admitted), default=None)
        tl.add("spare admitted", t_admit, node=admitted[0]["node"] if admitted else None,
               worker_store=sorted({e.get("worker_store") or "?" for e in admitted}) or None,
               distance=spare.get("distance") if admitted and spare.get("node") == admitted[0]["node"] else None)
        t_loaded = min((e["time"] for e in loaded), default=None)
        restore = (loaded[0].get("restore") or {}) if loaded else {}
        tl.add("snapshot loaded", t_loaded, start_step=loaded[0]["start"] if loaded else None,
               source=loaded[0]["source"] if loaded else None, tier=restore.get("tier"),
               phases=loaded[0].get("phases") if loaded else None)
        steps = [e for e in events if e["event"] == "step"]
        after = [e for e in steps if t_loaded is not None and e["time"] >= t_loaded]
        t_first = after[0]["time"] if after else None
        tl.add("first step on the spare", t_first, step=after[0]["step"] if after else None)
        finished = next((e for e in events if e["event"] == "finished"), None)
        tl.add("job finished", finished["time"] if finished else None)
        seen: dict[int, int] = {}
        for e in steps:
            seen[e["step"]] = seen.get(e["step"], 0) + 1
        lost = sorted(s for s, n in seen.items() if n > 1)
        final_nodes = sorted({e["node"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault})
        tl.events.sort(key=lambda e: e["time"])
        prev = tl.t0
        for e in tl.events:
            e["duration"] = round(e["time"] - prev, 3)
            prev = e["time"]
        result = {
            "fault": self.args.fault,
            "failed_node": victim.name,
            "timeline": tl.events,
            "finished": finished is not None,
            "spare_in_place": bool(admitted) and victim.name not in final_nodes,
            "replacement": admitted[0]["node"] if admitted else None,  # the spare that took the failed node's ranks
            "final_nodes": final_nodes,
            "recomputed_steps": lost,
            # worker groups formed after the fault (rank 0 admitted once per re-rendezvous)
            "membership_changes": sum(1 for e in events if e["event"] == "admitted" and e["rank"] == 0
                                      and e["time"] >= t_fault),
            "trip_to_first_step_seconds": round(t_first - times["tripped"], 3) if t_first and "tripped" in times else None,
            "fault_to_first_step_seconds": round(t_first - t_fault, 3) if t_first else None,
            "migration_notes": mig.get("notes", []),
            "spare_choice": mig.get("spare"),
            # the memory tier's replica placement as rank 0 printed it: at the start, and after the fault
            "replica_placement": [{"time": e["time"], "placement": e.get("placement")} for e in events
                                  if e["event"] == "replica_placement"],
            # every snapshot the job finished (ok or failed), as rank 0 logged it
            "snapshots": [{k: e.get(k) for k in ("step", "ok", "kind", "time", "node")}
                          for e in events if e["event"] == "snapshot"],
            "final": finished,
            "workdir": str(self.work),
            "restore": self._restore_report(events, t_fault),
        }
        if result["restore"].get("fallback"):
            result.setdefault("notes", []).append(result["restore"]["fallback"])
        if self.args.verify and finished:
            result["verify"] = self.verify(finished)
        ok = result["finished"] and result["spare_in_place"]
        if self.args.victims > self.args.spares and self.args.fault != "rank-crash":
            result["notes"] = [f"{self.args.victims} failed node(s) but {self.args.spares} spare(s): the job went on with "
                               f"{len(final_nodes)} node(s), resharded from the migrate snapshot"]
            result["world_after"] = max((e["world"] for e in events if e["event"] == "resumed" and e["time"] >= t_fault),
                                        default=None)
            ok = result["finished"] and victim.name not in final_nodes and not lost and bool(final_nodes)
            if "verify" in result:
                result["verify"]["note"] = "different world size: not expected to be bitwise equal"
            result["ok"] = ok
            return result
        memory = self.args.memory_interval_steps > 0
        # sudden losses: at most one step with the memory tier (unless every copy of a shard was
        # lost: then the disk snapshot, up to its interval); without it, up to the disk interval
        bound = max(1, self.args.interval_steps) if not memory or result["restore"]["tier"] == "disk" else 1
        if self.args.fault == "rank-crash":  # no migration: the same nodes carry on
            result["spare_in_place"] = False
            ok = result["finished"] and victim.name in final_nodes and len(lost) <= bound
            if memory:  # the node's own memory: no disk, no peer
                ok = ok and result["restore"]["tier"] == "memory" and not result["restore"]["peer"]
        elif self.args.fail_snapshot:
            # The migrate snapshot failed: the job resumes from the newest snapshot that did
            # commit and recomputes the steps from there to the step it held at. How many that
            # is depends on how long detection took, so no fixed bound is asserted.
            good = [s["step"] for s in result["snapshots"] if s["ok"] and t_loaded is not None and s["time"] < t_loaded]
            start = loaded[0]["start"] if loaded else None
            held = mig.get("snapshot_step")
            ok = (ok and held is not None and start == max(good, default=-1) + 1
                  and lost == list(range(start, held + 1)))
        elif self.args.fault == "kill":
            ok = ok and len(lost) <= bound
        elif self.args.fault in ("hang", "slow"):
            result["job_health"] = job_health(self.args.fault, events, times, mig, t_fault, t_first, failed=victim.name,
                                              replacement=result["replacement"])
            ok = ok and len(lost) <= 1 and result["job_health"]["ok"]
        else:
            ok = ok and not lost
        if "verify" in result:
            ok = ok and result["verify"]["bitwise_equal"]
        result["ok"] = ok
        return result

    def _restore_report(self, events: list[dict[str, Any]], t_fault: float) -> dict[str, Any]:
        """Where the ranks that resumed after the fault took their state from (rank 0's view;
        every rank agrees on the tier and step)."""
        resumed = [e for e in events if e["event"] == "resumed" and e["rank"] == 0 and e["time"] >= t_fault and e.get("restore")]
        if not resumed:
            return {"tier": None, "peer": [], "own": []}
        last = max(resumed, key=lambda e: e["time"])  # the restart that stuck
        r = last["restore"]
        out = {"tier": r.get("tier"), "step": last["start"] - 1, "own": r.get("own", []), "peer": r.get("peer", []),
               "disk": r.get("disk", []), "seconds": r.get("seconds"), "memory_rejected": r.get("memory_rejected", {})}
        if self.args.memory_interval_steps > 0 and r.get("tier") != "memory":
            out["fallback"] = (f"memory tier could not restore ({r.get('memory_reason') or 'unknown'}): fell back to "
                               f"the newest disk snapshot ({last['source'] or 'none'})")
        return out

    def verify(self, finished: dict[str, Any]) -> dict[str, Any]:
        cache = self.args.reference_cache
        if cache is None:
            want, error = self.reference_run(self.work / "reference")
        else:
            want, error = cached_reference(Path(cache), self.args.nodes * self.args.procs_per_node, self.args.steps,
                                           self.reference_run)
        if want is None:
            return {"bitwise_equal": False, "error": error}
        return {"bitwise_equal": want["params"] == finished["params"] and want["optim"] == finished["optim"],
                "reference_params_sha256": want["params"], "drill_params_sha256": finished["params"]}

    def reference_run(self, ref: Path) -> tuple[dict[str, Any] | None, str]:
        """The same job uninterrupted, under plain torchrun (independent of the agent under test):
        its final state, or None and why."""
        a = self.args
        ref.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nodes * a.procs_per_node}",
                "-m", "trainer.train", "--steps", str(a.steps), "--snapshot-dir", str(ref / "snapshots"),
                "--final", str(ref / "final.json")]
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=600, cwd=str(repo_root()))
        if r.returncode != 0:
            return None, r.stderr[-2000:]
        return json.loads((ref / "final.json").read_text()), ""

    def cleanup(self) -> None:
        pids = set()
        for n in self.nodes:
            try:
                pids.add(int(n.pidfile.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        for p in self.procs:
            pids.add(p.pid)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.time() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.snapshots)], capture_output=True)
        shutil.rmtree(self.memory_root, ignore_errors=True)
        if self.own_workdir and not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


class DrillError(RuntimeError):
    pass


PROGRESS_EVERY = 15.0  # seconds between "still waiting" lines on stderr
# A job left without a spare and not allowed fewer nodes waits for a node that a drill never brings:
# it is reported after this long past the fault, not at the end of --timeout
NO_NODE_WAIT_SECONDS = 20.0


def progress(message: str, out: Any = None) -> None:
    """One progress line on stderr (stdout stays the result: the timeline or --json)."""
    print(f"sentinel drill {time.strftime('%H:%M:%S')}: {message}", file=out or sys.stderr, flush=True)


def wait(predicate, timeout: float, what: str, *, clock=time.monotonic, sleep=time.sleep,
         report_every: float = PROGRESS_EVERY, out: Any = None) -> None:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass (DrillError). Says on
    stderr what it waits for, and again every ``report_every`` seconds while it waits."""
    start = clock()
    end = start + timeout
    next_report = start + report_every
    progress(f"waiting for {what} (up to {timeout:.0f} s)", out)
    while clock() < end:
        if predicate():
            return
        now = clock()
        if now >= next_report:
            progress(f"still waiting for {what}: {now - start:.0f} s of {timeout:.0f} s", out)
            next_report = now + report_every
        sleep(0.05)
    raise DrillError(f"timed out after {timeout:.0f} s waiting for {what}")


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def _pythonpath() -> str:
    parts = [str(repo_root())] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(parts)


def claim_spare(pool: Path, departed: str = "", topology_file: str = "") -> int:
    """The drill's spare_command: claim one free spare atomically and start its agent, detached.
    With a topology, the free spare nearest ``departed`` first; the choice is printed as one
    ``sentinel-spare-choice {json}`` line, which the command backend records."""
    frees = sorted(pool.glob("*.free"))
    if topology_file and departed and frees:
        from sentinel import topology

        try:
            topo = topology.merge(topology.read_file(topology_file))
        except topology.TopologyError as exc:
            print(f"topology not used: {exc}", file=sys.stderr)
        else:
            names = [f.name[:-len(".free")] for f in frees]
            choice = topology.choose_spare(topo, departed, names)
            if choice is not None:
                frees.sort(key=lambda f: f.name[:-len(".free")] != choice.node)
                print("sentinel-spare-choice " + json.dumps(choice.as_dict()))
    for free in frees:
        claimed = free.with_suffix(".claimed")
        try:
            os.rename(free, claimed)
        except FileNotFoundError:
            continue  # another node claimed it first
        spec = json.loads(free.with_suffix(".json").read_text())
        if spec.get("warm"):  # its agent is running and warm: let it join the rendezvous
            from sentinel.launch import admit

            if admit(Path(spec["pidfile"])) != 0:
                os.rename(claimed, free.with_suffix(".dead"))
                continue  # it died while waiting: the next one
            print(f"admitted warm spare {spec['name']}")
            return 0
        with open(spec["log"], "a") as out:
            subprocess.Popen(spec["argv"], env=spec["env"], stdout=out, stderr=subprocess.STDOUT, cwd=spec["cwd"],
                             start_new_session=True)
        print(f"started spare {spec['name']}")
        return 0
    print("no free spare in the pool", file=sys.stderr)
    return 1


def print_timeline(result: dict[str, Any]) -> None:
    print(f"drill: fault {result['fault']} on {result['failed_node']}   workdir {result['workdir']}")
    print(f"{'stage':<26} {'t (s)':>8} {'+ (s)':>8}  detail")
    for e in result["timeline"]:
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("stage", "time", "t", "duration") and v is not None)
        print(f"{e['stage']:<26} {e['t']:>8.2f} {e['duration']:>8.2f}  {detail}")
    print(f"trip -> first step on the spare: {result['trip_to_first_step_seconds']} s;"
          f" fault -> first step: {result['fault_to_first_step_seconds']} s")
    print(f"recomputed steps (work lost): {len(result['recomputed_steps'])} {result['recomputed_steps'] or ''}")
    rs = result.get("restore") or {}
    if rs.get("tier"):
        disk = f", from the disk snapshot of that step (every memory copy lost): {rs['disk']}" if rs.get("disk") else ""
        print(f"restored from: {rs['tier']}" + (f" at step {rs['step']} (shards from this node's memory: {rs['own']}, "
                                                f"from a peer's replica: {rs['peer']}{disk})" if rs["tier"] == "memory" else ""))
    for note in result["migration_notes"] + result.get("notes", []):
        print(f"note: {note}")
    if "verify" in result:
        print(f"verify: final parameters bitwise equal to an uninterrupted run: {result['verify']['bitwise_equal']}")
    print("drill: OK" if result["ok"] else "drill: FAILED")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--procs-per-node", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=2, help="simulated GPUs per node")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--interval-steps", type=int, default=10, help="periodic disk snapshots (the last resort)")
    p.add_argument("--memory-interval-steps", type=int, default=1,
                   help="in-memory snapshots with a peer replica every N steps (0: disk only)")
    p.add_argument("--migrate-ack", choices=("durable", "memory"), default="durable",
                   help="the ranks acknowledge a migrate snapshot once on disk (durable), or once in memory and "
                        "replicated (memory; on disk still when every copy of a shard would leave)")
    p.add_argument("--fault", choices=sorted(FAULTS), default="xid79")
    p.add_argument("--at-step", type=int, default=25)
    p.add_argument("--hang-mode", choices=["stop", "skip"], default="stop",
                   help="--fault hang: SIGSTOP one rank (stop) or make it never enter the collective (skip)")
    p.add_argument("--slow-factor", type=float, default=1.5, help="--fault slow: the node's ranks compute this much slower")
    p.add_argument("--handover-seconds", type=float, default=5.0,
                   help="the daemons' [job] handover_seconds: this drill's hand-over cost (bench/migration.py measures "
                        "about 1-2 s on one machine)")
    p.add_argument("--victims", type=int, default=1, help="fault this many nodes at the same moment")
    p.add_argument("--kill-spare", action="store_true", help="also kill the first spare as it starts (it dies mid-migration)")
    p.add_argument("--fail-snapshot", action="store_true",
                   help="the disk is full when the migrate snapshot is written (root: a small tmpfs is filled)")
    p.add_argument("--min-nodes", type=int, default=0, help="--nnodes minimum (default: --nodes)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--agent", choices=["warm", "torchrun"], default="warm",
                   help="warm: python -m trainer.elastic, preloaded forkserver, warm spares, graceful leave;"
                        " torchrun: plain torchrun and cold spares (the before)")
    p.add_argument("--rdzv-backend", choices=["c10d", "etcd-v2", "sentinel"], default="c10d",
                   help="c10d: a standalone TCPStore; etcd-v2: a local etcd (Debian etcd-server) on loopback; "
                        "sentinel: rank-preserving slots on the standalone TCPStore (--agent warm only)")
    p.add_argument("--start-method", choices=["spawn", "fork", "forkserver"], default="spawn",
                   help="torchrun worker start method (--agent torchrun; a -m module ignores it)")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--verify", action="store_true", help="also run uninterrupted and compare final parameters bitwise")
    p.add_argument("--reference-cache", metavar="DIR",
                   help="--verify: keep the uninterrupted run's final state in DIR and reuse it for the same world size, "
                        "steps and trainer code (drills of one job verify against one run; the test suite shares one)")
    p.add_argument("--json", action="store_true", help="print the machine-readable result")
    p.add_argument("--workdir", help="keep everything here (default: a temporary directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--topology", type=Path, metavar="FILE",
                   help="a topology file (Slurm topology.conf syntax, or TOML [nodes.<name>] nvlink/switches/rack/power, "
                        "docs/topology.md) naming node0.. and spare0..: the nearest spare is admitted, the timeline shows "
                        "its distance, the memory tier keeps each replica outside its holder's rack")
    p.add_argument("--scheduler", choices=["local", "slurm"], default="local",
                   help="slurm: run the job through a real Slurm cluster started here (root; slurm-wlm, munge): "
                        "the failed node is drained in Slurm, the spare comes from the job's allocation")
    p.add_argument("--slurm-conf", type=Path, metavar="PATH",
                   help="--scheduler slurm: use the running cluster of this slurm.conf (nodes node1..node4, idle) "
                        "instead of starting one; it is left running, with node4 drained by the admin check")

    p.add_argument("--user", default="",
                   help="with --scheduler slurm: submit the job as this ordinary user, as on a real cluster (the "
                        "daemons stay root; the job's launchers register with them)")
    p.add_argument("--job-python", default="",
                   help="the interpreter the job runs (default: this one); --user needs one that user can run")


def run_drill(args: argparse.Namespace) -> int:
    if args.rdzv_backend == "sentinel" and args.agent != "warm":
        print("sentinel drill: --rdzv-backend sentinel needs --agent warm (plain torchrun does not register it)",
              file=sys.stderr)
        return 2
    if args.slurm_conf is not None:
        print("sentinel drill: --slurm-conf needs --scheduler slurm", file=sys.stderr)
        return 2
    if getattr(args, "user", ""):
        print("sentinel drill: --user needs --scheduler slurm (the local drill runs its agents as root)", file=sys.stderr)
        return 2
    if args.spares < 1 and not args.min_nodes:
        print("sentinel drill: --spares 0 needs --min-nodes < --nodes (continue on fewer nodes)", file=sys.stderr)
    drill = Drill(args)
    try:
        result = drill.run()
    except DrillError as exc:
        print(f"sentinel drill: {exc}; logs in {drill.work}", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        drill.cleanup()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_timeline(result)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.drill")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("claim-spare")
    c.add_argument("--pool", required=True, type=Path)
    c.add_argument("--for", dest="departed", default="", help="the node the spare replaces")
    c.add_argument("--topology", default="", help="a topology file: the free spare nearest --for is claimed")
    args = ap.parse_args(argv)
    return claim_spare(args.pool, args.departed, args.topology)


if __name__ == "__main__":
    sys.exit(main())
