"""A real etcd cluster (Debian's ``etcd-server``) for the drill and the tests: 1 or 3 members.

    cluster = EtcdCluster(work, ["m0", "m1", "m2"], pki=make_job_pki(...))  # loopback ports
    cluster.start(); cluster.leader(); cluster.stop_member("m1"); cluster.stop()

Each member is its own ``etcd`` process with its own data directory; with ``hosts`` each runs
inside that host's network namespace (``run_on(host, argv)`` wraps the command) on the host's
address. With a :class:`sentinel.etcd_pki.JobPKI` the members serve HTTPS only, require a client
certificate signed by the job's CA (``--client-cert-auth``) and talk to each other over TLS with
the same CA (``--peer-client-cert-auth``). ``stop()`` kills every member it started, by pid.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from sentinel.etcd_pki import JobPKI
from sentinel_tools.ports import free_ports

# Raft timing for a cluster that must elect a new leader quickly after a power-off, on a loaded
# 2-core host: heartbeat 100 ms (etcd's default), election 1 s (its default)
HEARTBEAT_MS = 100
ELECTION_MS = 1000


@dataclass
class Member:
    name: str
    address: str
    client_port: int
    peer_port: int
    proc: subprocess.Popen | None = None
    log: Path | None = None
    extra: dict = field(default_factory=dict)


class EtcdCluster:
    """``names`` members; ``addresses`` (name -> IP, default 127.0.0.1) and ``run_on`` (name,
    argv -> argv) place them on the namespace cluster's hosts."""

    def __init__(self, work: Path, names: list[str], *, pki: JobPKI | None = None,
                 addresses: dict[str, str] | None = None,
                 run_on: Callable[[str, list[str]], list[str]] | None = None, token: str = "sentinel") -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd is not installed (Debian package etcd-server)")
        self.etcd = etcd
        self.work = work
        self.pki = pki
        self.run_on = run_on
        self.token = token
        ports = free_ports(2 * len(names)) if addresses is None else [2379, 2380] * len(names)
        self.members = {n: Member(n, (addresses or {}).get(n, "127.0.0.1"), ports[2 * i], ports[2 * i + 1])
                        for i, n in enumerate(names)}

    @property
    def scheme(self) -> str:
        return "https" if self.pki else "http"

    def endpoint(self) -> str:
        """The ``--rdzv-endpoint`` of the job: every member, comma-separated."""
        return ",".join(f"{m.address}:{m.client_port}" for m in self.members.values())

    def endpoints(self) -> list[tuple[str, int]]:
        return [(m.address, m.client_port) for m in self.members.values()]

    def _argv(self, m: Member) -> list[str]:
        client = f"{self.scheme}://{m.address}:{m.client_port}"
        peer = f"{self.scheme}://{m.address}:{m.peer_port}"
        initial = ",".join(f"{o.name}={self.scheme}://{o.address}:{o.peer_port}" for o in self.members.values())
        argv = [self.etcd, "--name", m.name, "--data-dir", str(self.work / f"etcd-{m.name}"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new", "--heartbeat-interval", str(HEARTBEAT_MS),
                "--election-timeout", str(ELECTION_MS), "--log-level", "warn", "--logger", "zap"]
        if self.pki:
            cert, key, ca = str(self.pki.member_cert(m.name)), str(self.pki.member_key(m.name)), str(self.pki.cacert)
            argv += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                     "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                     "--peer-client-cert-auth"]
        return argv

    def start(self, timeout: float = 60.0) -> None:
        """Start every member; return once the cluster has a leader that answers a write."""
        for m in self.members.values():
            self._spawn(m)
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def store(self, **kw):
        """An :class:`trainer.etcd_store.EtcdStore` on every member, with the job's client certificate."""
        from trainer.etcd_store import EtcdStore, EtcdTLS

        tls = EtcdTLS(str(self.pki.cacert), str(self.pki.client_cert), str(self.pki.client_key)) if self.pki else None
        return EtcdStore(self.endpoints(), tls=tls, **kw)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for m in self.members.values():
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited ({m.proc.returncode}): {self.tail(m)}")
            store = self.store(failover_seconds=2.0, request_seconds=2.0)
            try:
                store.set("sentinel.health", "1")
                if self.leader() is not None:
                    return
            except RuntimeError as exc:
                last = str(exc)
            finally:
                store.close()
            time.sleep(0.2)
        raise RuntimeError(f"etcd cluster not healthy within {timeout:g} s: {last}")

    def leader(self) -> str | None:
        """The name of the member that says it leads (asked of the members still running)."""
        store = self.store(failover_seconds=2.0, request_seconds=2.0)
        try:
            for row in store.members():
                if row["leader"]:
                    return row["name"]
        except RuntimeError:
            return None
        finally:
            store.close()
        return None

    def _spawn(self, m: Member, restart: bool = False) -> None:
        m.log = self.work / f"etcd-{m.name}.log"
        argv = self._argv(m)
        if restart:  # its data directory holds the cluster's membership: rejoin, do not bootstrap
            argv[argv.index("new")] = "existing"
        if self.run_on is not None:
            argv = self.run_on(m.name, argv)
        with open(m.log, "ab") as out:
            m.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def start_member(self, name: str, timeout: float = 60.0) -> None:
        """Start a stopped member again on its data directory (a host back from a power-off)."""
        self._spawn(self.members[name], restart=True)
        self.wait_healthy(timeout)

    def stop_member(self, name: str, sig: int = signal.SIGKILL) -> None:
        m = self.members[name]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            try:
                m.proc.wait(10)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(10)

    def tail(self, m: Member, n: int = 800) -> str:
        try:
            return m.log.read_text(errors="replace")[-n:] if m.log else ""
        except OSError:
            return ""

    def stop(self) -> None:
        for name in self.members:
            self.stop_member(name)
