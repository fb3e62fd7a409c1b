"""Hosts of their own on one machine: a network and a mount namespace per host, on one bridge.

Root only; plain iproute2 and util-linux. Every host of a :class:`NetnsCluster` gets:

* a network namespace ``sntl<id>-<host>`` whose ``eth0`` (a veth pair, the other end
  ``sntl<id>v<n>`` on the bridge ``sntl<id>br``) has an address from the benchmarking range
  198.18.0.0/15 and no route out: every packet a host sends stays on the bridge, and its
  loopback is its own;
* a mount namespace, kept by a *holder* process (``sleep``) that is the host's first process,
  with a private tmpfs on ``/dev/shm`` (the host's memory) and on ``/run`` (``/run/sentinel``
  is the daemon's runtime directory). A process joins the host with :meth:`Host.wrap`
  (``nsenter --net --mount``); the drill reads a host's files through ``/proc/<holder>/root``
  (:meth:`Host.view`).

Faults a host can have: :meth:`NetnsCluster.power_off` (SIGKILL to every process of the host
at once, its link removed: its tmpfs goes with its mount namespace), :meth:`partition` (the link
down while everything lives on) and :meth:`heal`, :meth:`shape` (``tc`` token-bucket shaping on
both directions of the link; this kernel has no ``netem``).

Teardown (:meth:`NetnsCluster.teardown`) removes every namespace, link, mount and process it
made. A record per cluster (``/run/sentinel-netns/<id>.json``: the owner's pid and start time,
every name) lets ``python -m sentinel_tools.netns cleanup`` remove what a crashed owner left,
and only that; ``cleanup --all`` removes every name with the ``sntl`` prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "sntl"  # every namespace and link this module makes starts with it, and nothing else's may
RECORDS = Path("/run/sentinel-netns")
SUBNET = "198.18.0"  # /24 on each cluster's own bridge; clusters never share a bridge
FIRST_HOST = 10  # 198.18.0.10 is the first host
HOST_RUNTIME = Path("/run/sentinel")
HOST_MEMORY = Path("/dev/shm")
SHM_SIZE = "1g"
HOLDER_READY_SECONDS = 20.0
KILL_WAIT_SECONDS = 10.0


class NetnsError(RuntimeError):
    pass


def missing() -> str:
    """Why a namespace cluster cannot run here, or "" when it can."""
    if os.geteuid() != 0:
        return "namespaced hosts need root (ip netns, veth pairs, tmpfs mounts)"
    for tool in ("ip", "nsenter", "unshare", "tc"):
        if not any(Path(d, tool).exists() for d in os.environ.get("PATH", "/usr/sbin:/usr/bin").split(":") + ["/usr/sbin"]):
            return f"namespaced hosts need {tool} (iproute2 / util-linux)"
    return ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def netns_pids(netns: str) -> list[int]:
    """Every process in network namespace ``netns`` (``ip netns pids``)."""
    r = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_netns(netns: str, timeout: float = KILL_WAIT_SECONDS) -> None:
    """SIGKILL every process of ``netns``, again and again until none is left (a process may fork
    while it is being killed); a zombie counts as gone. Raises NetnsError when some survive."""
    end = time.monotonic() + timeout
    while True:
        pids = [p for p in netns_pids(netns) if _state(p) not in ("Z", "")]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise NetnsError(f"processes {pids} of {netns} survive SIGKILL")
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


@dataclass
class Host:
    """One host of a cluster: its namespaces, its link on the bridge, its address."""

    name: str
    netns: str
    link: str  # the bridge's end of the host's veth pair (the host's own end is eth0)
    address: str
    holder: subprocess.Popen | None = None
    powered_off: bool = False

    @property
    def holder_pid(self) -> int:
        if self.holder is None:
            raise NetnsError(f"host {self.name} was not started")
        return self.holder.pid

    def wrap(self, argv: list[str], cwd: str | os.PathLike = "/") -> list[str]:
        """``argv`` run on this host: in its network and mount namespaces, in ``cwd``."""
        return ["nsenter", f"--target={self.holder_pid}", "--net", "--mount", f"--wd={cwd}", "--", *argv]

    @property
    def view_root(self) -> Path:
        return Path(f"/proc/{self.holder_pid}/root")

    def view(self, path: str | os.PathLike) -> Path:
        """``path`` as the host's processes see it, reached from outside the host."""
        return self.view_root / Path(path).relative_to("/")

    def inside(self, path: str | os.PathLike) -> Path:
        """The inverse of :meth:`view`: a path of the outside view as the host's processes name it;
        any other path (the shared work directory) is the same on both sides."""
        path = Path(path)
        try:
            return Path("/") / path.relative_to(self.view_root)
        except ValueError:
            return path

    def link_bytes(self) -> dict[str, int]:
        """Bytes through the host's link as the bridge counts them: ``to_host`` and ``from_host``."""
        stats = Path("/sys/class/net") / self.link / "statistics"
        try:
            return {"to_host": int((stats / "tx_bytes").read_text()), "from_host": int((stats / "rx_bytes").read_text())}
        except (OSError, ValueError):
            return {"to_host": 0, "from_host": 0}


@dataclass
class NetnsCluster:
    """Hosts named ``names`` on one bridge; :meth:`start` makes them, :meth:`teardown` removes all."""

    names: list[str]
    cluster_id: str = field(default_factory=lambda: secrets.token_hex(2))
    records: Path = RECORDS
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.names) > 200:
            raise NetnsError("at most 200 hosts on one bridge")
        self.prefix = f"{PREFIX}{self.cluster_id}"
        self.bridge = f"{self.prefix}br"
        for i, name in enumerate(self.names):
            self.hosts[name] = Host(name, f"{self.prefix}-{name}", f"{self.prefix}v{i}", f"{SUBNET}.{FIRST_HOST + i}")

    @property
    def record(self) -> Path:
        return self.records / f"{self.cluster_id}.json"

    def write_record(self) -> None:
        """Written before anything is made: a crash at any point leaves a record for ``cleanup``."""
        self.records.mkdir(mode=0o700, parents=True, exist_ok=True)
        me = os.getpid()
        self.record.write_text(json.dumps({
            "owner": me, "owner_start": _start_time(me), "bridge": self.bridge,
            "netns": [h.netns for h in self.hosts.values()], "links": [h.link for h in self.hosts.values()],
            "holders": {h.name: h.holder.pid for h in self.hosts.values() if h.holder is not None}}))

    def start(self) -> "NetnsCluster":
        """The bridge, then every host; on any failure everything made so far is removed."""
        why = missing()
        if why:
            raise NetnsError(why)
        self.write_record()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts.values():
                self._start_host(host)
            self.write_record()
        except BaseException:
            self.teardown()
            raise
        return self

    def _start_host(self, host: Host) -> None:
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _run("ip", "link", "set", host.link, "master", self.bridge, "up")
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        script = (f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 {self.prefix}-shm /dev/shm"
                  f" && mount -t tmpfs -o size=64m,mode=755 {self.prefix}-run /run"
                  f" && mkdir -m 755 {HOST_RUNTIME} && echo ready && exec sleep infinity")
        # ip netns exec and unshare exec, and sh execs sleep: the holder's pid is the Popen's
        host.holder = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation",
                                        "private", "--", "sh", "-c", script], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        end = time.monotonic() + HOLDER_READY_SECONDS
        while not host.view(HOST_RUNTIME).is_dir():
            if host.holder.poll() is not None:
                raise NetnsError(f"host {host.name} did not start: {host.holder.stderr.read().decode().strip()}")
            if time.monotonic() > end:
                raise NetnsError(f"host {host.name} not up after {HOLDER_READY_SECONDS:.0f} s")
            time.sleep(0.02)

    # -- faults ----------------------------------------------------------------------------------
    def power_off(self, name: str, silent: bool = False) -> None:
        """Every process of the host killed at once, its link removed: no goodbye. Its tmpfs
        mounts die with its mount namespace (the holder was its last process). ``silent``: the
        link goes down *before* the kill, so not even the kernel's FIN/RST for the killed
        processes' sockets leaves the host — its peers hear nothing, as from a host whose power
        went (the store-host fault: the agents must bound a call that gets no answer at all)."""
        host = self.hosts[name]
        if silent:
            _run("ip", "link", "set", host.link, "down", check=False)
        kill_netns(host.netns)
        if host.holder is not None:
            host.holder.wait(timeout=KILL_WAIT_SECONDS)
        _run("ip", "link", "del", host.link, check=False)
        host.powered_off = True

    def partition(self, name: str) -> None:
        """The host's link goes down; its processes live on, cut off."""
        _run("ip", "link", "set", self.hosts[name].link, "down")

    def heal(self, name: str) -> None:
        _run("ip", "link", "set", self.hosts[name].link, "up")

    def shape(self, name: str, rate: str = "20mbit") -> None:
        """Token-bucket shaping (``tbf``) of both directions of the host's link."""
        host = self.hosts[name]
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        _run("tc", "qdisc", "add", "dev", host.link, *tbf)  # towards the host
        _run("ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", *tbf)  # from the host

    # -- teardown --------------------------------------------------------------------------------
    def teardown(self) -> list[str]:
        """Every process, namespace and link of this cluster removed (what is already gone is
        skipped); the record last. Returns what could not be removed (empty when all went)."""
        left = _remove(self.bridge, [h.netns for h in self.hosts.values()], [h.link for h in self.hosts.values()])
        for host in self.hosts.values():
            if host.holder is not None:
                try:
                    host.holder.wait(timeout=KILL_WAIT_SECONDS)
                except subprocess.TimeoutExpired:
                    left.append(f"holder {host.holder.pid} of {host.name}")
        if not left:
            self.record.unlink(missing_ok=True)
        return left

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.teardown()


def _remove(bridge: str, netns: list[str], links: list[str]) -> list[str]:
    existing = set(list_netns())
    left = []
    for ns in netns:
        if ns not in existing:
            continue
        try:
            kill_netns(ns)
        except NetnsError as exc:
            left.append(str(exc))
        if _run("ip", "netns", "del", ns, check=False).returncode != 0:
            left.append(f"netns {ns}")
    for link in [*links, bridge]:
        # a veth goes with its namespace, asynchronously: what is gone by now needs nothing
        if link in list_links() and _run("ip", "link", "del", link, check=False).returncode != 0 \
                and link in list_links():
            left.append(f"link {link}")
    return left


def list_netns(prefix: str = PREFIX) -> list[str]:
    r = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(prefix)]


def list_links(prefix: str = PREFIX) -> list[str]:
    r = _run("ip", "-o", "link", "show", check=False)
    names = [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if line.count(":") >= 2]
    return [n for n in names if n.startswith(prefix)]


def leftovers(prefix: str = PREFIX) -> dict[str, list]:
    """What of any namespace cluster is still here: namespaces, links, and processes in them."""
    spaces = list_netns(prefix)
    return {"netns": spaces, "links": list_links(prefix),
            "processes": [pid for ns in spaces for pid in netns_pids(ns)]}


def cleanup(records: Path = RECORDS, everything: bool = False) -> list[str]:
    """Remove the clusters whose owner no longer runs (``everything``: every ``sntl`` name, any
    owner). Returns a line per cluster removed."""
    done = []
    for rec in sorted(records.glob("*.json")) if records.is_dir() else []:
        try:
            data = json.loads(rec.read_text())
        except (OSError, ValueError):
            continue
        if not everything and _start_time(data.get("owner", 0)) == data.get("owner_start"):
            continue  # its owner runs: not a leftover
        left = _remove(data["bridge"], data["netns"], data["links"])
        if not left:
            rec.unlink(missing_ok=True)
        done.append(f"{rec.stem}: removed {len(data['netns'])} host(s)" + (f"; left {left}" if left else ""))
    if everything:
        stray = leftovers()
        bridges = [n for n in stray["links"] if n.endswith("br")]
        left = _remove("", stray["netns"], [n for n in stray["links"] if n not in bridges] + bridges)
        if stray["netns"] or stray["links"]:
            done.append(f"stray: removed {stray['netns'] + stray['links']}" + (f"; left {left}" if left else ""))
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.netns", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cleanup", help="remove the namespace clusters whose owner is gone")
    c.add_argument("--all", action="store_true", help="every namespace and link named sntl*, whatever its owner")
    sub.add_parser("list", help="what of any namespace cluster is here")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print(json.dumps(leftovers(), indent=1))
        return 0
    if os.geteuid() != 0:
        print("sentinel_tools.netns: cleanup needs root", file=sys.stderr)
        return 1
    for line in cleanup(everything=args.all):
        print(line)
    return 0 if not any(leftovers().values()) or not args.all else 1


if __name__ == "__main__":
    sys.exit(main())
