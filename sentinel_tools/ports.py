"""Free loopback ports for the servers a drill or a test cluster starts later (a store, etcd,
slurmctld and slurmd), reserved host-wide so that two pickers never hand out the same one."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

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


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0
