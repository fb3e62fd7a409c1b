"""The workers' store of one generation: torch's ``TCPStore`` server, on a fresh port, listening
on the job's address only.

Slot 0's agent (:mod:`trainer.slot_rendezvous`) hosts one per generation: the agents assign worker
ranks through it, the workers' ``init_process_group`` meets in it, and the hang watch
(:mod:`trainer.progress`) writes its reports and verdict there. torch's store has no
authentication (issue #42 point 4, docs/security.md "The workers' store"); what this module
bounds is *where* it can be reached and *for how long*:

* **the job's address only**: ``TCPStore(host, 0, is_master=True)`` listens on every interface
  (``*:port``) whatever ``host`` says; here the listening socket is bound to ``addr`` (the
  address the agent advertises: ``--local-addr``, the host's bridge address on the namespace
  cluster) and handed to torch with ``master_listen_fd``: a process on another interface of the
  host (or in another network namespace) cannot reach it;
* **a fresh port**: port 0, chosen by the kernel at each generation;
* **one generation**: the rendezvous drops the server once the next generation commits
  (``SlotRendezvousHandler._servers``): its port and every connection to it close.

A local user can still find the port (``/proc/net/tcp`` lists listening sockets to everyone) and
connect; what it can do there, and how long it stalls the job, is measured by
tests/test_worker_store.py and written down in docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

log = logging.getLogger("sentinel.worker_store")

BACKLOG = 4096  # torch's own listen backlog for the store


def bind_address(addr: str) -> tuple[int, tuple]:
    """(family, sockaddr) to listen on for ``addr``. An IP address, or a name that resolves to a
    routable one, is bound as it is. A *name* that resolves to loopback (Debian's ``127.0.1.1
    <hostname>`` in /etc/hosts: the agent's default address is its FQDN) would bind the store
    where no other host reaches it, while the other hosts resolve the same name to the node's
    real address: there the store listens on every interface, as torch's own does, and the
    job should pass ``--local-addr``."""
    family, _, _, _, where = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    ip = ipaddress.ip_address(where[0].split("%")[0])
    literal = _is_ip(addr)
    if ip.is_loopback and not literal and addr != "localhost":
        log.warning("the workers' store's address %s resolves to %s (loopback): listening on every "
                    "interface; pass --local-addr to bind it to the job's interface", addr, ip)
        return socket.AF_INET6, ("::", 0)
    return family, (where[:2] if family == socket.AF_INET else where)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def listen(addr: str) -> socket.socket:
    """A TCP socket listening on ``addr`` (:func:`bind_address`), on a port the kernel picks."""
    family, where = bind_address(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def serve(addr: str) -> Any:
    """Start one generation's workers' store: a ``TCPStore`` server bound to ``addr`` only, on a
    fresh port (``.port``). torch owns the socket from here on and closes it with the server."""
    from torch.distributed import TCPStore

    sock = listen(addr)
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return TCPStore(host_name=addr, port=port, is_master=True, multi_tenant=True, wait_for_workers=False,
                        master_listen_fd=fd)
    except BaseException:
        socket.close(fd)
        raise
