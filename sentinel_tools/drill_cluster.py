"""The loopback cluster a drill runs on, and the drill's course over it.

A rendezvous store (a c10d TCPStore, or etcd with ``--rdzv-backend etcd-v2``), N "nodes" — each
a Sentinel daemon with its own simulated GPUs, runtime and state directories and metrics port,
plus an elastic agent running ``trainer/train.py`` — and S spare nodes, all processes of this
host on loopback (:mod:`sentinel_tools.drill` says how the agents and spares differ by
``--agent``). :class:`Drill` starts them, waits for step K, injects the fault
(:mod:`sentinel_tools.faults`), waits for the job to end and hands the rest to
:mod:`sentinel_tools.drill_report`. Every process it starts is stopped by :meth:`Drill.cleanup`.

This module never imports torch: the job runs in torchrun subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sentinel.sources import simulated
from sentinel_tools import drill_etcd, drill_report, faults
from sentinel_tools.drill_report import Timeline
from sentinel_tools.netns import HOST_RUNTIME
from sentinel_tools.harness import (TRAINER_JOBS, DrillError, trainer_job_argv, alive, descendants, progress, pythonpath,
                                    repo_root, wait)
from sentinel_tools.ports import free_port, port_open

SPARE_CALL_WAIT_SECONDS = 30.0

# A job left without a spare and not allowed fewer nodes waits for a node that a drill never brings:
# it is reported after this long past the fault, not at the end of --timeout (once an agent said
# whom its rendezvous round waits for: trainer/rdzv_watch.py's line, 10 s into its join; at most
# twice this long more)
NO_NODE_WAIT_SECONDS = 20.0


@dataclass
class Node:
    name: str
    root: Path
    spare: bool
    daemon: subprocess.Popen | None = None
    agent: subprocess.Popen | None = None
    metrics_port: int | None = None
    # a host of its own (sentinel_tools.netns.Host) or None: a process of this machine on loopback
    host: Any = None

    @property
    def runtime(self) -> Path:
        """The runtime directory as the drill reaches it (a namespaced host's own /run/sentinel)."""
        return self.host.view(HOST_RUNTIME) if self.host is not None else self.root / "run"

    def local(self, path: Path) -> Path:
        """``path`` (the drill's view) as the node's own processes name it."""
        return self.host.inside(path) if self.host is not None else path

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def gpus(self) -> Path:
        return self.root / "gpus.json"

    @property
    def pidfile(self) -> Path:
        return self.runtime / "agent.pid"



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
        self.peer_key = self.work / "peer.key"  # the daemons' shared key for forwarded hang verdicts
        self.peers_file = self.work / "peers.json"
        self.peer_ports: dict[str, int] = {}
        self.etcd: drill_etcd.DrillEtcd | None = None  # --rdzv-backend sentinel-etcd
        self.job_dead_at: float | None = None  # when every agent of the job was seen gone (the job did not finish)
        # Each node's memory-tier holder: a tmpfs directory of its own ("node memory").
        self.memory_root = Path("/dev/shm") / f"sentinel-drill-{os.getpid()}-{os.urandom(3).hex()}"
        # plain torchrun keeps the first round's worker-store address for good (a spare deadlocks
        # waiting for MASTER_ADDR): its rank-0 worker hosts the store instead; trainer.elastic
        # forgets the address every round, and its rank-0 agent hosts the store (README)
        # TORCH_FR_BUFFER_SIZE: torch's flight recorder (gloo too), from which the guard tells a
        # rank's compute from its waiting (docs/hangs-and-stragglers.md); 64 entries hold a
        # progress window of this job's collectives and keep a dump cheap
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath(),
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
        if self.args.rdzv_backend == drill_etcd.BACKEND:
            self.etcd = drill_etcd.DrillEtcd(self.work, ["m0", "m1", "m2"])
            self.etcd.start(max(30.0, self.args.timeout / 3))
            self.procs += self.etcd.procs()
            return
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
        wait(lambda: port_open(self.store_port), max(30.0, self.args.timeout / 3), "rendezvous store")

    def agent_argv(self, node: Node) -> list[str]:
        a = self.args
        nnodes = f"{a.min_nodes or a.nodes}:{a.nodes}"
        # etcd-v2 is torch's dynamic rendezvous (as c10d) with its state in etcd: the same settings
        # read_timeout: a store call on a store whose host is gone fails after 10 s, not torch's 60 s
        # (the agent then says in one line that the job cannot go on: --fault store-host)
        rdzv_conf = {"etcd-v2": "protocol=http,", drill_etcd.BACKEND: self.etcd.rdzv_conf() if self.etcd else ""}.get(
            a.rdzv_backend, "is_host=false,read_timeout=10,") + (
            f"keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout={int(a.timeout)}")
        if getattr(a, "silence_window", None) and a.rdzv_backend.startswith("sentinel"):
            rdzv_conf += f",silence_window={a.silence_window:g}"
        py = self.python
        launch = [py, "-m", "sentinel", "launch", "--pidfile", str(node.local(node.pidfile)), "--state-dir",
                  str(node.state_dir)]
        if a.agent == "warm":
            launch += ["--warm"] if node.spare else []
            modules = TRAINER_JOBS[self.trainer][1] if self.trainer in TRAINER_JOBS else ("trainer.train",)
            preload = [x for m in modules for x in ("--preload", m)]
            agent = [py, "-m", "trainer.elastic", *preload, "--ready-file", str(node.local(self.ready_file(node))), "--"]
        else:
            agent = [py, "-m", "torch.distributed.run", f"--start-method={a.start_method}"]
        return [
            *launch, "--", *agent, f"--nnodes={nnodes}", f"--nproc-per-node={a.procs_per_node}",
            f"--rdzv-backend={a.rdzv_backend}", f"--rdzv-endpoint={self.store_endpoint()}", f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={rdzv_conf}", f"--max-restarts={a.max_restarts}", "--monitor-interval=0.1",
            *self.job_argv(),
        ]

    @property
    def trainer(self) -> str:
        """The job: reference (trainer/train.py), lightning or torchtitan (examples/)."""
        return getattr(self.args, "trainer", "reference")

    def job_argv(self) -> list[str]:
        """What every agent runs: trainer/train.py, or the stock Lightning script (its Sentinel
        settings come through the environment, :meth:`node_env`: the script is not changed)."""
        a = self.args
        if self.trainer in TRAINER_JOBS:
            return trainer_job_argv(self.trainer, a, self.job_dir, a.procs_per_node, a.nodes)
        return [
            "-m", "trainer.train", "--steps", str(a.steps), "--snapshot-dir", str(self.snapshots),
            "--interval-steps", str(a.interval_steps), "--step-seconds", str(a.step_seconds),
            "--progress", str(self.progress), "--final", str(self.job_dir / "final.json"),
            # a hang drill waits for the hang watch (T >= 30 s by default), not the process-group timeout
            "--migrate-hold-seconds", "30", "--pg-timeout", str(faults.get(a.fault).pg_timeout_seconds),
            "--memory-interval-steps", str(a.memory_interval_steps), "--migrate-ack", a.migrate_ack,
        ]

    def store_endpoint(self) -> str:
        """Where the agents reach the rendezvous store."""
        return self.etcd.endpoint() if self.etcd else f"127.0.0.1:{self.store_port}"

    def on_node(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` run on ``node`` (here: a process of this machine, as it is)."""
        return argv

    def memory_dir(self, node: Node) -> Path:
        """The node's memory-tier directory (a tmpfs: "node memory"), as its processes name it."""
        return self.memory_root / node.name

    def forget_memory(self, node: Node) -> None:
        """The node's memory died with it."""
        shutil.rmtree(self.memory_root / node.name, ignore_errors=True)

    def ready_file(self, node: Node) -> Path:
        """Where a warm agent says it is warm."""
        return node.runtime / "warm.json"

    def node_env(self, node: Node) -> dict[str, str]:
        env = {**self.env, "SENTINEL_RUNTIME_DIR": str(node.local(node.runtime)), "SENTINEL_NODE": node.name,
               "SENTINEL_DRILL_FAULT_FILE": str(node.local(node.runtime / "drill-fault")),
               "SENTINEL_MEMORY_DIR": str(self.memory_dir(node)),
               "SENTINEL_PROGRESS_FILE": str(self.progress)}  # the agents record slots declared vacant there too
        if self.trainer in TRAINER_JOBS:  # the integration's settings and the drill's progress record
            env.update({"SENTINEL_FINAL_FILE": str(self.job_dir / "final.json"),
                        "SENTINEL_INTERVAL_STEPS": str(self.args.interval_steps), "SENTINEL_MIGRATE_HOLD_SECONDS": "30",
                        "SENTINEL_MEMORY_INTERVAL_STEPS": str(self.args.memory_interval_steps),
                        "SENTINEL_DRILL_STEP_SECONDS": str(self.args.step_seconds)})
        if self.args.topology:  # the memory tier places each replica outside its holder's rack
            env["SENTINEL_TOPOLOGY"] = str(self.args.topology)
        return env

    def make_node(self, index: int, spare: bool) -> Node:
        name = f"spare{index}" if spare else f"node{index}"
        node = self.new_node(name, spare)
        node.root.mkdir(parents=True, exist_ok=True)
        node.runtime.mkdir(parents=True, exist_ok=True)
        node.runtime.chmod(0o755)
        simulated.write_state(node.gpus, simulated.healthy_state(self.args.gpus_per_node))
        spare_cmd = json.dumps(self.spare_command())
        topology = f'[actions.topology]\nfile = {json.dumps(str(self.args.topology))}\n' if self.args.topology else ""
        (node.root / "sentinel.toml").write_text(
            "[daemon]\npoll_interval_seconds = 0.2\nnvml_deadline_seconds = 1.0\n"
            f'runtime_dir = "{node.local(node.runtime)}"\nstate_dir = "{node.state_dir}"\nnode_name = "{name}"\n'
            'log_level = "info"\n'
            '[metrics]\nlisten_address = "127.0.0.1"\nport = 0\n'
            "[policy]\nlead_time_seconds = 600.0\ndebounce_samples = 3\n"
            f"[actions]\nack_timeout_seconds = 30.0\nbackend = \"command\"\nspare_command = {spare_cmd}\n"
            f"[job]\nhandover_seconds = {self.args.handover_seconds}\n"
            f'peer_key_file = "{self.peer_key}"\npeers_file = "{self.peers_file}"\n'
            f'peer_listen_address = "{self.peer_address(node)}"\n'
            "[ebpf]\nenabled = false\nkmsg_fallback = false\n"  # drills must not react to the host's kernel log
            + topology
        )
        if spare:
            self.pool.mkdir(exist_ok=True)
            (self.pool / f"{name}.json").write_text(json.dumps({
                "name": name, "argv": self.on_node(node, self.agent_argv(node)), "env": self.node_env(node),
                "log": str(node.root / "agent.log"), "cwd": str(repo_root()),
                "warm": self.args.agent == "warm", "pidfile": str(node.pidfile),
            }))
            (self.pool / f"{name}.free").write_text("")
        return node

    def peer_address(self, node: Node) -> str:
        """Where ``node``'s daemon hears hang verdicts forwarded by the others (sentinel.peers)."""
        if node.name not in self.peer_ports:
            self.peer_ports[node.name] = free_port()
        return f"127.0.0.1:{self.peer_ports[node.name]}"

    def write_peers(self) -> None:
        """The job's peer key (root's, 0600) and every node's peer address, before any daemon starts."""
        fd = os.open(self.peer_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(24).hex())
        self.peers_file.write_text(json.dumps({n.name: self.peer_address(n) for n in self.nodes}))

    def spare_command(self) -> list[str]:
        """The daemons' ``spare_command`` (``{node}``: the node it replaces)."""
        return self.claim_argv("{node}")

    def claim_argv(self, departed: str) -> list[str]:
        """The spare command: with --topology, the free spare nearest ``departed``."""
        argv = [sys.executable, "-m", "sentinel_tools.drill", "claim-spare", "--pool", str(self.pool)]
        if self.args.topology:
            argv += ["--for", departed, "--topology", str(self.args.topology)]
        return argv

    def start_daemon(self, node: Node) -> None:
        node.daemon = self.spawn(self.on_node(node, [sys.executable, "-m", "sentinel", "run", "--config",
                                                     str(node.root / "sentinel.toml"), "--simulate", str(node.gpus),
                                                     "--no-ebpf"]), node.root / "daemon.log")

    def wait_daemon(self, node: Node) -> None:
        status = node.runtime / "status.json"
        wait(lambda: status.exists() or (node.daemon and node.daemon.poll() is not None), max(60.0, self.args.timeout / 3),
             f"{node.name} daemon")
        if node.daemon and node.daemon.poll() is not None:
            raise DrillError(f"{node.name}'s daemon exited: {(node.root / 'daemon.log').read_text()[-1500:]}")
        node.metrics_port = json.loads(status.read_text())["metrics_port"]

    def start_agent(self, node: Node) -> None:
        node.agent = self.spawn(self.on_node(node, self.agent_argv(node)), node.root / "agent.log",
                                env=self.node_env(node))

    def new_node(self, name: str, spare: bool) -> Node:
        return Node(name, self.work / name, spare)

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
        t = time.time()
        faults.get(self.args.fault).inject(self, victim)
        return t

    def _ranks_of(self, victim: Node) -> list[int]:
        below = set(descendants(victim.agent.pid)) if victim.agent is not None else set()
        return [e["pid"] for e in reversed(self.events())
                if e["event"] == "admitted" and e["node"] == victim.name and e.get("pid") in below]

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

    def start_cluster(self, t_start: float) -> None:
        """The store, every node's daemon, and the agents (warm spares too, waited for until warm)."""
        a = self.args
        progress(f"starting {a.nodes} node(s) and {a.spares} spare(s) in {self.work}")
        self.start_store()
        self.nodes = [self.make_node(i, False) for i in range(a.nodes)] + [self.make_node(i, True) for i in range(a.spares)]
        self.write_peers()
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
        self.start_cluster(t_start)
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
        fault = faults.get(a.fault)
        fault.follow_up(self, victims, deadline)
        short = a.spares < a.victims and fault.replaces_node
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
            if any(e["event"] == "finished" for e in events):
                return True
            if self._job_dead():
                self.job_dead_at = time.time()
                return True
            return False

        if "waiting for a node" in what:  # nothing will come: say so after a bounded look, not at the deadline,
            look = time.time() + NO_NODE_WAIT_SECONDS  # once an agent said whom its round waits for (or 40 s on)
            wait(lambda: done() or time.time() >= look and bool(drill_report.rendezvous_stalls(self)),
                 max(1.0, min(deadline, look + 2 * NO_NODE_WAIT_SECONDS) - time.time()), what)
            if not (self.job_dead_at or any(e["event"] == "finished" for e in self.events())):
                raise DrillError(f"timed out after {time.time() - t_fault:.0f} s waiting for {what}")
        wait(done, max(1.0, deadline - time.time()), what)
        self._wait_spare_calls(victims, deadline)
        result = self.report(tl, victim, t_fault)
        if self.spare_notes:
            result.setdefault("notes", []).extend(self.spare_notes)
        if len(victims) > 1:
            self._other_victims(result, victims, fault)
        return result

    def _other_victims(self, result: dict[str, Any], victims: list[Node], fault: faults.Fault) -> None:
        """--victims N: every other victim drained too, and none of them in the final job."""
        others = [self._migration(v) for v in victims[1:]]
        result["other_failed_nodes"] = [v.name for v in victims[1:]]
        result["other_migrations"] = [{"node": v.name, "phase": m.get("phase"), "snapshot_step": m.get("snapshot_step")}
                                      for v, m in zip(victims[1:], others)]
        # a sudden kill has no migration: the scheduler replaced the nodes
        drained = fault.sudden or all(m.get("phase") == "drained" for m in others)
        result["final_nodes_ok"] = not set(result["final_nodes"]) & {v.name for v in victims}
        result["ok"] = result["ok"] and drained and result["final_nodes_ok"]

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
        """Every agent of the job exited, and no claimed spare is on its way. A warm spare still
        waiting outside the rendezvous is not part of the job: its agent keeps nothing alive."""
        agents = [n.agent for n in self.nodes if n.agent is not None
                  and (not n.spare or (self.pool / f"{n.name}.claimed").exists())]
        claimed = [n for n in self.nodes if n.spare and (self.pool / f"{n.name}.claimed").exists()
                   and not (self.pool / f"{n.name}.dead").exists()]
        return bool(agents) and all(p.poll() is not None for p in agents) and not claimed

    def straggler_seen(self, node: Node) -> dict[str, Any] | None:
        """The newest straggler score ``node``'s daemon holds (its status file), or None."""
        try:
            job = json.loads((node.runtime / "status.json").read_text()).get("job") or {}
        except (OSError, ValueError, AttributeError):
            return None
        st = job.get("straggler") if isinstance(job, dict) else None
        return st if isinstance(st, dict) else None

    def host_report(self) -> dict[str, Any]:
        """What the report adds about the hosts (namespaced hosts: addresses, bytes over the bridge)."""
        return {}

    def report(self, tl: Timeline, victim: Node, t_fault: float) -> dict[str, Any]:
        return drill_report.report(self, tl, victim, t_fault)

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
        if self.etcd is not None:
            self.etcd.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.snapshots)], capture_output=True)
        shutil.rmtree(self.memory_root, ignore_errors=True)
        if self.own_workdir and not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


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

