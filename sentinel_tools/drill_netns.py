"""`sentinel drill --hosts netns`: the drill's nodes as hosts of their own (root only).

Every node, every spare and the rendezvous store is a host of a
:class:`sentinel_tools.netns.NetnsCluster`: its own network namespace and address on one
bridge, its own ``/dev/shm`` (the memory tier's "node memory") and ``/run/sentinel`` (the
daemon's runtime directory: socket, status, agent pidfile), its own daemon and agent. The job's
traffic can only go over the bridge: the agents reach the store at its host's address, each
agent advertises its own (``--local-addr``) for the workers' store, gloo is bound to ``eth0``,
and a host's loopback reaches nobody else. What stays shared is what a cluster shares too: the
work directory (the disk snapshots' filesystem, the job's progress log) and the scheduler's
spare pool.

The drill reads a host's files through ``/proc/<holder>/root``; a fault of a whole host
(power-off, partition, slow link) acts on its namespaces; teardown removes every namespace,
link, mount and process, also when the drill fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from sentinel_tools import drill_etcd, netns
from sentinel_tools.drill_cluster import Drill, Node
from sentinel_tools.harness import DrillError, progress, repo_root, wait

STORE_HOST = "store"
SCHEDULER_HOST = "sched"
SCHEDULER_CALL_SECONDS = 20.0
PEER_PORT = 9470  # each daemon's peer listener, on its own host's address
STORE_LOSS_LINE = "trainer.elastic: the rendezvous store"  # trainer.elastic's one line when its store is gone


class NetnsDrill(Drill):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.cluster: netns.NetnsCluster | None = None
        self.store_proc = None
        self.bytes_at_fault: dict[str, dict[str, int]] = {}
        self.fault_times: list[float] = []  # when each victim was hit
        self.etcd_at_fault: dict[str, Any] = {}  # --rdzv-backend sentinel-etcd: members and leader before the fault
        self.healed_at: float | None = None  # --fault partition: when the link came back
        self.scheduler_port = 8080  # on the scheduler's own host: nothing else listens there
        self.scheduler_token = self.work / "scheduler.token"

    def host_names(self) -> list[str]:
        a = self.args
        return [STORE_HOST, SCHEDULER_HOST] + [f"node{i}" for i in range(a.nodes)] + [f"spare{i}" for i in range(a.spares)]

    def start_cluster(self, t_start: float) -> None:
        why = netns.missing()
        if why:
            raise DrillError(f"--hosts netns: {why}")
        self.cluster = netns.NetnsCluster(self.host_names())
        progress(f"starting {len(self.cluster.hosts)} namespaced hosts on bridge {self.cluster.bridge}")
        try:
            self.cluster.start()
        except netns.NetnsError as exc:
            raise DrillError(f"--hosts netns: {exc}") from None
        self.start_scheduler()
        super().start_cluster(t_start)

    def start_scheduler(self) -> None:
        """The scheduler's host: the daemons' spare calls reach it over the bridge."""
        sched, log = self.host(SCHEDULER_HOST), self.work / "scheduler.log"
        self.scheduler_token.write_text(os.urandom(16).hex())
        self.scheduler_token.chmod(0o600)
        argv = [sys.executable, "-m", "sentinel_tools.drill_scheduler", "serve", "--address", sched.address,
                "--port", str(self.scheduler_port), "--pool", str(self.pool), "--token-file", str(self.scheduler_token)]
        if self.args.topology:
            argv += ["--topology", str(self.args.topology)]
        proc = self.spawn(sched.wrap(argv, cwd=repo_root()), log)

        def up() -> bool:
            return proc.poll() is not None or (log.exists() and "scheduler listening" in log.read_text())

        wait(up, max(30.0, self.args.timeout / 3), f"the scheduler on {sched.address}")
        if proc.poll() is not None:
            raise DrillError(f"the scheduler on host {SCHEDULER_HOST} exited: {log.read_text()[-1500:]}")

    def spare_command(self) -> list[str]:
        sched = self.host(SCHEDULER_HOST)
        return [sys.executable, "-m", "sentinel_tools.drill_scheduler", "claim", "--url",
                f"http://{sched.address}:{self.scheduler_port}", "--for", "{node}", "--token-file",
                str(self.scheduler_token), "--timeout", str(SCHEDULER_CALL_SECONDS)]

    def host(self, name: str) -> netns.Host:
        assert self.cluster is not None
        return self.cluster.hosts[name]

    # -- where things run and how they are reached ----------------------------------------------
    def new_node(self, name: str, spare: bool) -> Node:
        node = Node(name, self.work / name, spare)
        node.host = self.host(name)
        return node

    def on_node(self, node: Node, argv: list[str]) -> list[str]:
        return node.host.wrap(argv, cwd=repo_root()) if node.host is not None else argv

    def peer_address(self, node: Node) -> str:
        return f"{node.host.address}:{PEER_PORT}" if node.host is not None else super().peer_address(node)

    def store_endpoint(self) -> str:
        if self.etcd is not None:
            return self.etcd.endpoint()
        return f"{self.host(STORE_HOST).address}:{self.store_port}"

    def start_store(self) -> None:
        if self.args.rdzv_backend == drill_etcd.BACKEND:
            assert self.cluster is not None
            a = self.args  # the victims are nodes 1.. (drill_cluster): this fault keeps the members off them
            avoid = tuple(f"node{i}" for i in range(1, 1 + a.victims)) if a.fault == "power-off-leader-replacing" else ()
            names = drill_etcd.member_hosts(list(self.cluster.hosts), avoid)
            self.etcd = drill_etcd.DrillEtcd(
                self.work, names, addresses={n: self.host(n).address for n in names},
                run_on=lambda name, argv: self.host(name).wrap(argv, cwd=repo_root()),
                probe_on=lambda argv: self.host(SCHEDULER_HOST).wrap(argv, cwd=repo_root()))
            progress(f"etcd members on {', '.join(names)}")
            self.etcd.start(max(30.0, self.args.timeout / 3))
            self.procs += self.etcd.procs()
            return
        if self.args.rdzv_backend == "etcd-v2":
            raise DrillError("--hosts netns runs the job's own TCPStore (c10d or sentinel); etcd-v2 is not wired yet")
        store, log = self.host(STORE_HOST), self.work / "store.log"
        self.store_proc = self.spawn(store.wrap([sys.executable, "-m", "trainer.store", "--host", store.address,
                                                 "--port", str(self.store_port)], cwd=repo_root()), log)
        proc = self.store_proc

        def up() -> bool:
            return proc.poll() is not None or (log.exists() and "store listening" in log.read_text())

        wait(up, max(30.0, self.args.timeout / 3), f"rendezvous store on {store.address}")
        if proc.poll() is not None:
            raise DrillError(f"the store on host {STORE_HOST} exited: {log.read_text()[-1500:]}")

    def agent_argv(self, node: Node) -> list[str]:
        argv = super().agent_argv(node)
        # the address this agent's host advertises (the workers' store on the rank-0 agent)
        at = next(i for i, x in enumerate(argv) if x.startswith("--nnodes="))
        return [*argv[:at], f"--local-addr={node.host.address}", *argv[at:]]

    def node_env(self, node: Node) -> dict[str, str]:
        # gloo binds to the host's bridge interface, never its loopback
        return {**super().node_env(node), "GLOO_SOCKET_IFNAME": "eth0"}

    def forget_memory(self, node: Node) -> None:
        if node.host is not None and not node.host.powered_off:
            shutil.rmtree(node.host.view(self.memory_dir(node)), ignore_errors=True)

    # -- host faults -------------------------------------------------------------------------
    def inject(self, victim: Node) -> float:
        assert self.cluster is not None
        if self.etcd is not None and victim.name in self.etcd.cluster.members and not self.fault_times:
            self.etcd_at_fault = self.etcd.lead_from(victim.name)  # the victim's host runs the leader
        self.bytes_at_fault = {name: h.link_bytes() for name, h in self.cluster.hosts.items()}
        t = super().inject(victim)
        self.fault_times.append(t)
        return t

    def power_off(self, node: Node) -> None:
        assert self.cluster is not None
        self.cluster.power_off(node.name, silent=True)  # link down first: no FIN/RST leaves, as when power goes

    def partition(self, node: Node) -> None:
        assert self.cluster is not None
        self.cluster.partition(node.name)

    def heal(self, node: Node) -> None:
        assert self.cluster is not None
        self.cluster.heal(node.name)

    def shape(self, node: Node, rate: str) -> None:
        assert self.cluster is not None
        self.cluster.shape(node.name, rate)

    def power_off_store(self) -> None:
        assert self.cluster is not None
        self.cluster.power_off(STORE_HOST, silent=True)  # no FIN/RST: the agents hear nothing

    def bridge_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes through each host's link since the fault (``to_host``, ``from_host``)."""
        assert self.cluster is not None
        out = {}
        for name, h in self.cluster.hosts.items():
            now, then = h.link_bytes(), self.bytes_at_fault.get(name, {"to_host": 0, "from_host": 0})
            out[name] = {k: max(0, now[k] - then[k]) for k in now} if not h.powered_off else {"to_host": 0, "from_host": 0}
        return out

    def host_report(self) -> dict[str, Any]:
        assert self.cluster is not None
        out: dict[str, Any] = {"netns_cluster": self.cluster.prefix,
                               "hosts": {name: h.address for name, h in self.cluster.hosts.items()},
                               "bridge_bytes_since_fault": self.bridge_bytes()}
        if self.etcd is not None:
            out["etcd"] = {"before_fault": self.etcd_at_fault, "at_end": self.etcd.probe()}
        if self.host(STORE_HOST).powered_off:
            out["failed_node"] = STORE_HOST  # the fault's victim is the store's host, not a node
            out["store_lost"] = self.store_lost()
        return out

    def store_lost(self) -> dict[str, Any]:
        """What the agents said when the store's host went: the first agent's one line, and how
        long after the fault the drill saw the whole job gone."""
        lines = []
        for n in self.nodes:
            try:
                text = (n.root / "agent.log").read_text(errors="replace")
            except OSError:
                continue
            lines += [f"{n.name}: {line}" for line in text.splitlines() if line.startswith(STORE_LOSS_LINE)]
        t_fault = next(iter(self.fault_times), None)
        seconds = round(self.job_dead_at - t_fault, 3) if self.job_dead_at and t_fault else None
        daemons = [n.name for n in self.nodes if not n.spare or n.agent is not None
                   if ((self.daemon_job_status(n) or {}).get("rendezvous") or {}).get("reachable") is False]
        return {"line": lines[0] if lines else "", "agents_saying_so": len(lines), "seconds_after_fault": seconds,
                "daemons_saying_so": daemons}

    def daemon_job_status(self, node: Node) -> dict[str, Any] | None:
        """The ``job`` part of ``node``'s daemon status (what ``sentinel status`` prints)."""
        try:
            job = json.loads((node.runtime / "status.json").read_text()).get("job")
        except (OSError, ValueError, AttributeError):
            return None
        return job if isinstance(job, dict) else None

    def cleanup(self) -> None:
        try:
            super().cleanup()
        finally:
            if self.cluster is not None:
                left = self.cluster.teardown()
                if left:
                    progress(f"teardown left {left}: python -m sentinel_tools.netns cleanup removes it")
