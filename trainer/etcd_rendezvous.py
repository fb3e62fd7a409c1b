"""``--rdzv-backend sentinel-etcd``: the slot rendezvous (:mod:`trainer.slot_rendezvous`) with its
membership in a replicated etcd v3 (:mod:`trainer.etcd_store`) instead of one TCPStore.

    --rdzv-backend sentinel-etcd --rdzv-endpoint H1:2379,H2:2379,H3:2379 --nnodes N:N \\
    --rdzv-conf cacert=CA.pem,cert=CLIENT.pem,key=CLIENT.key[,request_timeout=3,failover_timeout=20]

Same protocol, same rank preservation, same ``--rdzv-conf`` timeouts as ``sentinel``; the job
survives the loss of any minority of the etcd members (the host running one powers off, a member
is partitioned away). ``cacert`` alone checks the members; ``cert`` + ``key`` are the job's
client certificate, which members started with ``--client-cert-auth`` require. Without
``cacert`` the members are reached over plain HTTP (a test cluster on loopback only: anyone who
reaches the port can rewrite the job's membership; docs/security.md). Fixed sizes only: a
``--nnodes`` range is refused (torch's dynamic handler has no etcd v3 backend to fall back on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from trainer.etcd_store import (
    BACKEND,
    DEFAULT_FAILOVER_SECONDS,
    DEFAULT_REQUEST_SECONDS,
    EtcdStore,
    EtcdTLS,
    parse_endpoints,
)
from trainer.rdzv_conf import count as _count, seconds as _seconds
from trainer.slot_rendezvous import SlotRendezvousHandler


def tls_of(params: RendezvousParameters) -> EtcdTLS | None:
    """The job's CA and client certificate from ``--rdzv-conf`` (readable files, or ValueError)."""
    cacert, cert, key = (params.get(k) for k in ("cacert", "cert", "key"))
    if not cacert:
        if cert or key:
            raise ValueError("--rdzv-conf cert/key need cacert (the job's CA) as well")
        return None
    if bool(cert) != bool(key):
        raise ValueError("--rdzv-conf cert and key go together")
    for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
        if path and not Path(path).is_file():
            raise ValueError(f"--rdzv-conf {name}={path}: no such file")
    return EtcdTLS(str(cacert), str(cert) if cert else None, str(key) if key else None)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The slot handler on an :class:`EtcdStore` of every ``--rdzv-endpoint`` member."""
    if params.min_nodes != params.max_nodes:
        raise ValueError(f"--rdzv-backend {BACKEND} needs a fixed size (--nnodes N:N), not "
                         f"{params.min_nodes}:{params.max_nodes}")
    interval = _seconds(params, "keep_alive_interval", 5.0)
    attempts = _count(params, "keep_alive_max_attempt", 3)
    admission = _seconds(params, "admission_timeout", 0.0) if params.get("admission_timeout") else None
    store = EtcdStore(parse_endpoints(params.endpoint), tls=tls_of(params),
                      request_seconds=_seconds(params, "request_timeout", DEFAULT_REQUEST_SECONDS),
                      failover_seconds=_seconds(params, "failover_timeout", DEFAULT_FAILOVER_SECONDS),
                      lease_ttl=admission or interval * attempts)
    return SlotRendezvousHandler(
        store, params.run_id, params.max_nodes, local_addr=params.local_addr,
        join_timeout=_seconds(params, "join_timeout", 600.0), keep_alive_interval=interval,
        keep_alive_max_attempt=attempts, admission_timeout=admission, backend=BACKEND)


def register() -> None:
    """Make ``--rdzv-backend sentinel-etcd`` known to torch's registry (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass


def torchrun_entry_point() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point for plain torchrun."""
    return create_handler
