"""The systems bench/peers.py compares, how each is started, faulted and read (never imports torch:
each job runs in its own interpreter, a peer's in its own virtual environment).

A system lays its job out on *nodes*: each node a list of root processes the harness started
(and whatever they start). ``kill`` SIGKILLs every process of node1 (the roots and all their
descendants, with no warning); the harness, acting as the scheduler, then gives the job a fresh
node1 at once where the system needs one (torch elastic, torchft: a cold start; NVRx and Sentinel
start their spares up front). ``rank-crash`` makes node1's first rank raise at its next step.
``xid79`` is a predicted failure: only Sentinel sees it; for the others it is a ``kill`` at the
same step, and the report says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
from sentinel_tools.harness import descendants  # noqa: E402
from sentinel_tools.ports import free_ports  # noqa: E402

VENVS = Path(os.environ.get("SENTINEL_PEERS_VENVS", "/var/cache/sentinel-peers"))
CRASH_FILE_ENV = "PEERS_CRASH_FILE"  # bench/peer_jobs/common.py reads it


@dataclass
class Run:
    """One job of one system: its work directory, nodes and files."""

    work: Path
    steps: int
    step_seconds: float
    fault: str = ""
    nodes: dict[str, list[subprocess.Popen]] = field(default_factory=dict)
    extra: list[subprocess.Popen] = field(default_factory=list)  # torchft's Lighthouse
    ports: list[int] = field(default_factory=list)

    @property
    def progress(self) -> Path:
        return self.work / "progress.jsonl"

    @property
    def final(self) -> Path:
        return self.work / "final.json"

    def events(self) -> list[dict]:
        if not self.progress.exists():
            return []
        out = []
        for line in self.progress.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
        return out

    def env(self, **more: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                CRASH_FILE_ENV: str(self.work / "crash"), **more}

    def spawn(self, node: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.work / f"{node}-{len(self.nodes.get(node, []))}.log", "ab")
        p = subprocess.Popen(argv, cwd=REPO, env={**env, "PEERS_NODE": node}, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        log.close()
        self.nodes.setdefault(node, []).append(p)
        return p

    def kill_node(self, node: str) -> None:
        """SIGKILL every process of ``node``: its roots and everything below them, at once."""
        pids = []
        for p in self.nodes.get(node, []):
            pids += [p.pid, *descendants(p.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.nodes.get(node, []):
            p.wait()
        self.nodes[node] = []

    def alive(self) -> bool:
        return any(p.poll() is None for ps in self.nodes.values() for p in ps)

    def tree_rss_bytes(self) -> int:
        """The resident memory of every process of the job now (pages from /proc/PID/statm)."""
        pids = set()
        for p in [*(p for ps in self.nodes.values() for p in ps), *self.extra]:
            if p.poll() is None:
                pids |= {p.pid, *descendants(p.pid)}
        total = 0
        for pid in pids:
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def cleanup(self) -> None:
        for node in list(self.nodes):
            self.kill_node(node)
        for p in self.extra:
            if p.poll() is None:
                p.kill()
            p.wait()


def job_args(run: Run, script: str, *more: str) -> list[str]:
    return [str(JOBS / script), "--steps", str(run.steps), "--step-seconds", str(run.step_seconds),
            "--progress", str(run.progress), "--final", str(run.final), *more]


class Peer:
    """A system other than Sentinel. ``launch`` starts node0 and node1; ``replace`` starts a
    fresh node1 after a kill (the scheduler's part); ``crash_rank`` is the rank that raises for
    rank-crash; ``writers`` the step writers whose log says the job's progress."""

    name = ""
    label = ""
    venv = ""
    sees_prediction = False
    how = ""  # the configuration, one line, for the report

    def python(self) -> str:
        return str(VENVS / self.venv / "bin" / "python") if self.venv else sys.executable

    def available(self) -> str:
        """'' when the system can be started here, else why not (one line)."""
        if self.venv and not Path(self.python()).exists():
            return f"no virtual environment at {VENVS / self.venv} (run scripts/peers-venvs)"
        return ""

    def launch(self, run: Run, baseline: bool = False) -> None:
        raise NotImplementedError

    def replace(self, run: Run) -> None:
        raise NotImplementedError

    crash_rank = 2


class ElasticDCP(Peer):
    name, label, venv = "elastic_dcp", "torch elastic + DCP", ""
    how = ("torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3, c10d rendezvous, "
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, DDP, dcp.async_save every K steps")
    interval = 5
    script = "elastic_dcp.py"

    def _agent(self, run: Run, node: str, more: list[str]) -> None:
        store = run.ports[0]
        argv = [self.python(), "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store}",
                "--rdzv-id", f"peers-{store}", "--monitor-interval", "0.1", *job_args(run, self.script, *more)]
        # node0's agent hosts the rendezvous store; the others (a replacement node1 too) only
        # join it (on one host, left to itself, whichever agent binds first would host it)
        argv.insert(argv.index("--rdzv-id"), f"--rdzv-conf=is_host={'true' if node == 'node0' else 'false'}")
        run.spawn(node, argv, run.env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))

    def launch(self, run: Run, baseline: bool = False) -> None:
        run.ports = free_ports(1)
        more = ["--no-ft"] if baseline else ["--ckpt-dir", str(run.work / "ckpt"), "--interval-steps", str(self.interval)]
        self.more = more
        for node in ("node0", "node1"):
            self._agent(run, node, more)

    def replace(self, run: Run) -> None:
        self._agent(run, "node1", self.more)


class NoFT(ElasticDCP):
    """The same loop with no fault tolerance at all: the steady-state baseline (DDP; --fsdp: FSDP2
    as trainer.train shards it, Sentinel's baseline)."""

    name, label = "none", "no fault tolerance (DDP)"

    def launch(self, run: Run, baseline: bool = True) -> None:
        run.ports = free_ports(1)
        self.more = ["--no-ft"] + (["--fsdp"] if self.name == "none_fsdp" else [])
        for node in ("node0", "node1"):
            self._agent(run, node, self.more)


class NoFTFSDP(NoFT):
    name, label = "none_fsdp", "no fault tolerance (FSDP2)"


class TorchFT(Peer):
    name, label, venv = "torchft", "torchft 0.2.0", "torchft"
    how = ("Lighthouse --min_replicas 1 (5 s heartbeat timeout), 4 replica groups of 1 rank (2 per node), "
           "each torchrun --max-restarts 3; Manager on ProcessGroupGloo, PGTransport, use_async_quorum=False")
    crash_rank = 2  # replica group 2: node1's first
    lighthouse_args: tuple[str, ...] = ()

    def launch(self, run: Run, baseline: bool = False) -> None:
        run.ports = free_ports(1)
        lh = str(VENVS / self.venv / "bin" / "torchft_lighthouse")
        log = open(run.work / "lighthouse.log", "ab")
        run.extra.append(subprocess.Popen([lh, "--min_replicas", "1", "--bind", f"127.0.0.1:{run.ports[0]}",
                                           *self.lighthouse_args],
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
        (run.work / "barrier").mkdir()
        for g in range(4):
            self._group(run, g, barrier=True)

    def _group(self, run: Run, g: int, barrier: bool) -> None:
        env = run.env(REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS="4",
                      TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{run.ports[0]}",
                      PEERS_START_BARRIER=str(run.work / "barrier") if barrier else "")
        argv = [self.python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "--max-restarts", "3", "--monitor-interval", "0.1", *job_args(run, "torchft_job.py")]
        run.spawn(f"node{g // 2}", argv, env)

    def replace(self, run: Run) -> None:
        for g in (2, 3):
            self._group(run, g, barrier=False)


class TorchFTTuned(TorchFT):
    """torchft with its failure detection tuned: the Lighthouse's heartbeat timeout, the time a dead
    group holds the next quorum back, from its 5 s default to 1 s (10 of the Managers' 100 ms
    heartbeats; `torchft_lighthouse --heartbeat_timeout_ms`, the only quorum timeout that a sudden
    loss waits for: the join timeout waits for stragglers only when fewer than --min_replicas
    groups heartbeat)."""

    name, label = "torchft_tuned", "torchft 0.2.0, 1 s heartbeat timeout"
    how = TorchFT.how.replace("5 s heartbeat timeout", "--heartbeat_timeout_ms 1000")
    lighthouse_args = ("--heartbeat_timeout_ms", "1000")


class NVRx(Peer):
    name, label, venv = "nvrx", "NVRx 0.4.1 in-process", "nvrx"
    how = ("inprocess.Wrapper, 4 active ranks + 2 warm spares (a spare node), "
           "Compose(MaxActiveWorldSize(4), FillGaps()), health_check=None, state kept in memory")

    def launch(self, run: Run, baseline: bool = False) -> None:
        run.ports = free_ports(1)
        for r in range(6):  # node0: ranks 0-1, node1: 2-3, spare: 4-5
            env = run.env(RANK=str(r), LOCAL_RANK=str(r % 2), WORLD_SIZE="6", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(run.ports[0]))
            run.spawn(("node0", "node1", "spare")[r // 2], [self.python(), *job_args(run, "nvrx_job.py", "--active", "4")],
                      env)

    def replace(self, run: Run) -> None:
        return None  # its spares are already running


class DLRover(Peer):
    name, label, venv = "dlrover", "DLRover 0.6.1", "dlrover"
    how = "dlrover-run --standalone --nproc_per_node 2 (flash checkpoint needs it to start first)"

    def launch(self, run: Run, baseline: bool = False) -> None:
        argv = [str(VENVS / self.venv / "bin" / "dlrover-run"), "--standalone", "--nproc_per_node", "2",
                *job_args(run, "elastic_dcp.py", "--ckpt-dir", str(run.work / "ckpt"))]
        run.spawn("node0", argv, run.env())

    def replace(self, run: Run) -> None:
        return None


class SentinelSteady(ElasticDCP):
    """Sentinel's job in steady state, as `sentinel drill` runs it: trainer.train (FSDP2) under
    Sentinel's warm agent (python -m trainer.elastic, trainer.train preloaded) on the slot
    rendezvous (--rdzv-backend sentinel), its SnapshotGuard with the memory tier every step (a
    replica on the other node), disk snapshots every 10 steps; no fault, so no daemon is needed
    for the step-time figure."""

    name, label = "sentinel", "Sentinel"

    def launch(self, run: Run, baseline: bool = False) -> None:
        run.ports = free_ports(1)
        for node in ("node0", "node1"):
            self._agent(run, node, [])

    def _agent(self, run: Run, node: str, more: list[str]) -> None:
        store = run.ports[0]
        argv = [self.python(), "-m", "trainer.elastic", "--preload", "trainer.train", "--",
                "--nnodes", "2:2", "--nproc-per-node", "2", "--rdzv-backend", "sentinel",
                "--rdzv-endpoint", f"127.0.0.1:{store}", "--rdzv-id", f"peers-{store}",
                f"--rdzv-conf=is_host={'true' if node == 'node0' else 'false'},keep_alive_interval=1",
                "--monitor-interval", "0.1",
                "-m", "trainer.train", "--steps", str(run.steps), "--step-seconds", str(run.step_seconds),
                "--snapshot-dir", str(run.work / "snap"), "--interval-steps", "10", "--memory-interval-steps", "1",
                "--progress", str(run.progress), "--final", str(run.final)]
        run.spawn(node, argv, run.env(SENTINEL_NODE=node))


PEERS: dict[str, Peer] = {p.name: p for p in (ElasticDCP(), TorchFT(), TorchFTTuned(), NVRx(), DLRover())}
# the no-fault, unpadded runs: each system's steady state, and the loops without fault tolerance
STEADY: dict[str, Peer] = {p.name: p for p in (NoFT(), NoFTFSDP(), SentinelSteady(), ElasticDCP(), TorchFT(), TorchFTTuned(), NVRx())}


def first_error_line(run: Run) -> str:
    """The last line that names an error in the job's logs (what the table shows for a crash)."""
    best = ""
    for log in sorted(run.work.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if ("Error" in line or "error:" in line) and "Warning" not in line:
                best = line.strip()[:240]
    return best or "no error line in the logs"


def wait_for(pred, timeout: float, run: Run) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False
