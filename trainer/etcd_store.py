"""The slot rendezvous's store on a replicated etcd v3 (``--rdzv-backend sentinel-etcd``).

    python -m trainer.elastic -- --rdzv-backend sentinel-etcd --nnodes N:N \\
        --rdzv-endpoint HOST1:2379,HOST2:2379,HOST3:2379 \\
        --rdzv-conf cacert=/run/job/ca.pem,cert=/run/job/client.pem,key=/run/job/client.key ...

:class:`EtcdStore` offers the narrow store interface :class:`trainer.slot_rendezvous.
SlotRendezvousHandler` uses (``get set add compare_set check wait clone beat``, with c10d's
semantics), each a few requests to etcd's v3 JSON gateway through ``etcd3gw`` (the OpenStack
client of that gateway: maintained, pure Python over ``requests``; no gRPC stack, so it installs
beside torch without touching protobuf). Nothing here agrees on anything: etcd's Raft does.

* ``compare_set``: one transaction: the key absent (``create_revision == 0``) or its value equal
  to the expected one, else the current value comes back in the same request.
* ``add`` (a ticket counter, c10d's ``add``): etcd has no increment, and a compare-and-set loop on
  one counter key retries O(N) times when N survivors arrive at once (torch's dynamic
  rendezvous's cost). Instead each ``add`` puts a key of its own under ``<key>/+/`` (no
  conflict: never retried) and counts the prefix in the same transaction: transactions are
  serialised, so the k-th one counts k — one request whatever N is. Re-sent after an ambiguous
  failure (the leader died with the request in flight), the key exists already and the count is
  taken at its create revision: the number stays the one the first try got.
* ``wait``: a linearizable range, then a watch from the next revision (the generation is
  learned by a watch, not by polling), each bounded in time.
* ``beat``: the slot's heartbeat key is attached to a lease of ``lease_ttl`` seconds kept alive
  with each beat: a host that powers off stops beating and its key is deleted by etcd when the
  lease expires, with no goodbye; the watcher then declares the slot vacant. etcd never expires a
  lease without a leader, and a new leader extends every lease by an election timeout (its lessor's
  ``Promote``), so an election alone expires nobody. A beat waits at most ``beat_seconds`` per
  member (``lease_ttl / (members + 1)``, at most ``request_seconds``) before it tries the next one:
  a beat begun on a member that hangs (its host powered off; a follower forwarding the keep-alive to
  a leader that died) still reaches a member that answers well within its lease.
* ``leader_term``: the highest Raft term any answer of this connection carried. It changes only
  with an election, during which etcd takes no write: the keep-alive rule
  (:meth:`trainer.slot_recovery.Recovery.keepalive_pass`) counts no heartbeat as stale over a
  window in which it changed.
* ``fenced_set``: a write that holds only while the generation key still says the writer's
  generation (a transaction comparing it): a node cut off in an older generation cannot write.

Endpoints: a request goes to the current member; a connection error, a timeout or etcd's
"no leader" (HTTP 503/504) moves to the next member, round robin, for up to ``failover_seconds``
(a new leader is elected within a few election timeouts). Every error left over is a
:class:`EtcdStoreError` (a ``RuntimeError``, as torch's stores raise); a wait that runs out raises
one whose text says "timeout" (what the handler checks).

TLS: with ``cacert`` (and ``cert``/``key``) every request is HTTPS, the members' certificate is
checked against the job's CA and the client presents the job's certificate; members started with
``--client-cert-auth`` refuse anyone else (docs/security.md).
"""

from __future__ import annotations

import base64
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

BACKEND = "sentinel-etcd"
DEFAULT_REQUEST_SECONDS = 3.0
DEFAULT_FAILOVER_SECONDS = 20.0
WAIT_TIMEOUT = 300.0  # a get of a missing key waits for it, as a c10d store's get does
RETRYABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
             etcd_errors.InternalServerError)


class EtcdStoreError(RuntimeError):
    """etcd could not answer (no member reachable, no leader within ``failover_seconds``), or a
    wait ran out (then the text says "timeout")."""


@dataclass(frozen=True)
class EtcdTLS:
    """The job's CA (checks the members) and the job's client certificate and key."""

    cacert: str
    cert: str | None = None
    key: str | None = None


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def parse_endpoints(text: str, default_port: int = 2379) -> list[tuple[str, int]]:
    """``host1:port1,host2:port2`` (``[v6]:port`` too) -> [(host, port)]; ValueError on a bad one."""
    out: list[tuple[str, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        host, sep, port = part.rpartition(":")
        if not sep or "]" in port:
            host, port = part, str(default_port)
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {part!r}: not HOST:PORT")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class EtcdStore:
    """One connection (an ``Etcd3Client`` per member, one current) to the job's etcd cluster.
    Thread-safe for counting; give each thread its own with :meth:`clone`."""

    def __init__(self, endpoints: list[tuple[str, int]], *, tls: EtcdTLS | None = None,
                 request_seconds: float = DEFAULT_REQUEST_SECONDS, failover_seconds: float = DEFAULT_FAILOVER_SECONDS,
                 lease_ttl: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.tls = tls
        self.request_seconds = request_seconds
        self.failover_seconds = failover_seconds
        self.lease_ttl = max(2, math.ceil(lease_ttl))
        self._clock = clock
        protocol = "https" if tls else "http"
        self._clients = [Etcd3Client(host, port, protocol, timeout=request_seconds, api_path="/v3/",
                                     session=self._session(tls)) for host, port in self.endpoints]
        # the heartbeat's own timeout per member: a beat that hangs on one member must reach
        # another before its lease runs out (module docstring)
        self.beat_seconds = min(request_seconds, max(0.5, self.lease_ttl / (len(self.endpoints) + 1)))
        self._beat_clients = [Etcd3Client(c.host, c.port, protocol, timeout=self.beat_seconds, api_path="/v3/",
                                          session=c.session) for c in self._clients]
        self.leader_term = 0  # the highest Raft term seen in an answer (an election raises it)
        self._current = 0
        self._lease: int | None = None
        self._lock = threading.Lock()
        self.requests = 0  # HTTP requests sent (what the scale bench counts for etcd)

    @staticmethod
    def _session(tls: EtcdTLS | None) -> requests.Session:
        """A session that takes nothing from the environment: requests lets ``REQUESTS_CA_BUNDLE``
        override a session's own CA, and ``HTTPS_PROXY`` would route the rendezvous through a proxy."""
        session = requests.Session()
        session.trust_env = False
        if tls is not None:
            session.verify = tls.cacert
            if tls.cert and tls.key:
                session.cert = (tls.cert, tls.key)
        return session

    # -- transport -----------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], *, beat: bool = False) -> dict[str, Any]:
        """POST to the current member; on a member that cannot answer, the next (round robin)
        until ``failover_seconds`` have passed. Re-sent requests are idempotent by design.
        ``beat``: a heartbeat's request, ``beat_seconds`` per member."""
        deadline = self._clock() + self.failover_seconds
        last: Exception | None = None
        tried = 0
        while True:
            client = (self._beat_clients if beat else self._clients)[self._current]
            with self._lock:
                self.requests += 1
            try:
                out = client.post(client.get_url(path), data=json.dumps(body))
                term = int(out.get("header", {}).get("raft_term", 0) or 0) if isinstance(out, dict) else 0
                self.leader_term = max(self.leader_term, term)
                return out
            except RETRYABLE as exc:
                last = exc
            except etcd_errors.Etcd3Exception as exc:  # refused (auth, bad request): no other member will differ
                raise EtcdStoreError(f"etcd {client.host}:{client.port} refused {path}: "
                                     f"{(exc.detail_text or str(exc))[:300]}") from None
            except OSError as exc:  # requests' own: the CA or certificate file is gone or unreadable
                raise EtcdStoreError(f"etcd {client.host}:{client.port}: {exc}") from None
            self._current = (self._current + 1) % len(self._clients)
            tried += 1
            if self._clock() >= deadline:
                raise EtcdStoreError(f"etcd unreachable: no member of {self._names()} answered {path} within "
                                     f"{self.failover_seconds:g} s ({type(last).__name__}: {str(last)[:200]})")
            if tried % len(self._clients) == 0:
                time.sleep(min(0.2, max(0.0, deadline - self._clock())))  # every member said no: an election

    def _names(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None) -> dict[str, Any]:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _range(self, key: str, **extra: Any) -> dict[str, Any]:
        return self._post("/kv/range", {"key": _b64(key), **extra})

    # -- the store interface -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The key's value; a missing key is waited for (c10d's get blocks the same way)."""
        kvs = self._range(key).get("kvs")
        if not kvs:
            self.wait([key], timedelta(seconds=WAIT_TIMEOUT))
            kvs = self._range(key).get("kvs") or [{}]
        return _unb64(kvs[0].get("value", ""))

    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(key), "value": _b64(value)})

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """c10d semantics: set ``desired`` when the key is absent and ``expected`` is empty, or the
        key holds ``expected``; return the value the key holds afterwards (``expected`` when the
        key is absent and ``expected`` is not empty, as c10d does). One transaction."""
        b_key = _b64(key)
        expected_b = expected.encode() if isinstance(expected, str) else expected
        desired_b = desired.encode() if isinstance(desired, str) else desired
        if expected_b:
            cond = {"key": b_key, "target": "VALUE", "result": "EQUAL", "value": _b64(expected_b)}
        else:
            cond = {"key": b_key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        out = self._txn([cond], [{"request_put": {"key": b_key, "value": _b64(desired_b)}}],
                        [{"request_range": {"key": b_key}}])
        if out.get("succeeded"):
            return desired_b
        kvs = out["responses"][0].get("response_range", {}).get("kvs")
        return _unb64(kvs[0].get("value", "")) if kvs else expected_b

    def add(self, key: str, n: int) -> int:
        """c10d's ``add`` for the protocol's counters (arrivals, tickets): ``n`` keys of this call's
        own under ``<key>/+/`` and, in the same transaction, the count of the prefix (it sees the
        keys of every earlier transaction and this one's: exactly this call's number). One request;
        re-sent after an ambiguous failure, the keys exist already and the count is taken as of
        their creation instead. ``add(key, 0)`` is the count alone. Counters only grow (n >= 0)."""
        if n < 0:
            raise ValueError("etcd counters only grow")
        prefix = f"{key}/+/"
        end = _b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))
        count = {"request_range": {"key": _b64(prefix), "range_end": end, "count_only": True}}
        if n == 0:
            return int(self._range(prefix, range_end=end, count_only=True).get("count", 0))
        op = uuid.uuid4().hex
        mine = [_b64(f"{prefix}{op}.{i}") for i in range(n)]
        out = self._txn([{"key": mine[0], "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                        [{"request_put": {"key": k, "value": ""}} for k in mine] + [count],
                        [{"request_range": {"key": mine[0]}}])
        if out.get("succeeded"):
            return int(out["responses"][-1]["response_range"].get("count", 0))
        # our keys were written by a first try whose answer was lost: count as of their revision
        created = int(out["responses"][0]["response_range"]["kvs"][0]["create_revision"])
        try:  # the keyspace as it was then: exactly the keys created at or before ours
            return int(self._range(prefix, range_end=end, count_only=True, revision=created).get("count", 0))
        except EtcdStoreError as exc:
            if "compacted" not in str(exc):
                raise
        # an operator's auto-compaction removed that revision: list the keys instead (etcd's
        # count ignores max_create_revision, which filters only the keys it returns)
        got = self._range(prefix, range_end=end, keys_only=True, max_create_revision=created)
        return len(got.get("kvs", []))

    def check(self, keys: list[str]) -> bool:
        """All ``keys`` exist: one transaction of compares, nothing written."""
        out = self._txn([{"key": _b64(k), "target": "CREATE", "result": "GREATER", "create_revision": "0"}
                         for k in keys], [])
        return bool(out.get("succeeded"))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Until every key exists: a range, then a watch from the revision after it; raises
        :class:`EtcdStoreError` ("timeout") when ``timeout`` passes first."""
        deadline = self._clock() + timeout.total_seconds()
        for key in keys:
            while True:
                got = self._range(key, keys_only=True)
                if got.get("kvs"):
                    break
                left = deadline - self._clock()
                if left <= 0:
                    raise EtcdStoreError(f"wait for {key}: timeout after {timeout.total_seconds():g} s")
                if self._watch_put(key, int(got["header"]["revision"]) + 1, left):
                    break

    def _watch_put(self, key: str, revision: int, seconds: float) -> bool:
        """True at the first put of ``key`` at or after ``revision``; False after ``seconds``
        without one, or when the member failed (the caller ranges again). etcd3gw's own watch has no timeout on its stream
        (a watch on a powered-off member would hang), so the gateway's ``/v3/watch`` is read here
        with requests' connect and read timeouts."""
        client = self._clients[self._current]
        body = {"create_request": {"key": _b64(key), "start_revision": revision, "filters": ["NODELETE"]}}
        with self._lock:
            self.requests += 1
        try:
            with client.session.post(client.get_url("/watch"), data=json.dumps(body), stream=True,
                                     timeout=(self.request_seconds, max(0.05, seconds))) as resp:
                if resp.status_code != 200:
                    self._current = (self._current + 1) % len(self._clients)
                    return False
                for line in resp.iter_lines():
                    if line and json.loads(line).get("result", {}).get("events"):
                        return True
        except (requests.exceptions.RequestException, ValueError):
            # a read timeout (no put in time) or a member gone: the caller's range decides which
            return False
        return False

    def clone(self) -> "EtcdStore":
        """A second connection to the same members (the heartbeat's own)."""
        return EtcdStore(self.endpoints, tls=self.tls, request_seconds=self.request_seconds,
                         failover_seconds=self.failover_seconds, lease_ttl=self.lease_ttl, clock=self._clock)

    def beat(self, key: str, value: str | bytes, *, fence: tuple[str, str] | None = None) -> bool:
        """Heartbeat: ``key`` = ``value`` attached to this connection's lease, kept alive here. A
        lease that expired (a partition longer than its TTL) is replaced by a new one. With ``fence``
        = ``(fence_key, token)`` the write is in one transaction with the compare of ``fence_key``
        to ``token`` (:func:`trainer.fence.fenced_set`): False, nothing written, once it moved on."""
        compare = [] if fence is None else [
            {"key": _b64(fence[0]), "target": "VALUE", "result": "EQUAL", "value": _b64(fence[1])}]
        if self._lease is not None:
            answer = self._post("/lease/keepalive", {"ID": self._lease}, beat=True)
            if int(answer.get("result", {}).get("TTL", -1)) <= 0:
                self._lease = None
        if self._lease is not None:
            put = {"request_put": {"key": _b64(key), "value": _b64(value), "lease": self._lease}}
            return bool(self._post("/kv/txn", {"compare": compare, "success": [put], "failure": []},
                                   beat=True).get("succeeded"))
        self._lease = int(self._post("/lease/grant", {"TTL": self.lease_ttl, "ID": 0}, beat=True)["ID"])
        # who holds the lease, kept past its expiry (no lease on it): a watcher tells "beat, then
        # died" from "has not beaten yet" (a slot's new owner whose first beat is on its way)
        owner = (value.decode() if isinstance(value, bytes) else value).rsplit(":", 1)[0]
        out = self._post("/kv/txn", {"compare": compare, "failure": [], "success": [
            {"request_put": {"key": _b64(f"{key}.owner"), "value": _b64(owner)}},
            {"request_put": {"key": _b64(key), "value": _b64(value), "lease": self._lease}}]}, beat=True)
        return bool(out.get("succeeded"))

    def beat_owner(self, key: str) -> str | None:
        """The node whose lease last carried heartbeat ``key`` (None: nobody ever beat there)."""
        kvs = self._range(f"{key}.owner").get("kvs")
        return _unb64(kvs[0].get("value", "")).decode() if kvs else None

    def fenced_set(self, fence_key: str, token: str, key: str, value: str | bytes) -> bool:
        """Write ``key`` only while ``fence_key`` still holds ``token`` (one transaction; the
        signature :func:`trainer.fence.fenced_set` calls): a writer from an older generation is
        refused. True when written."""
        out = self._txn([{"key": _b64(fence_key), "target": "VALUE", "result": "EQUAL", "value": _b64(token)}],
                        [{"request_put": {"key": _b64(key), "value": _b64(value)}}])
        return bool(out.get("succeeded"))

    # -- what the daemon and the drill show ----------------------------------------------------------
    def members(self) -> list[dict[str, Any]]:
        """Each member: name, client URLs, whether it answered, and whether it is the leader."""
        listed = self._post("/cluster/member/list", {}).get("members", [])
        leader = None
        out = []
        for m in listed:
            row = {"id": str(m.get("ID", "")), "name": m.get("name", ""), "client_urls": m.get("clientURLs", []),
                   "reachable": False, "leader": False}
            for url in row["client_urls"]:
                status = self._status_of(url)
                if status is not None:
                    row["reachable"] = True
                    leader = status.get("leader", leader)
                    break
            out.append(row)
        for row in out:
            row["leader"] = leader is not None and row["id"] == str(leader)
        return out

    def move_leader(self, name: str) -> None:
        """Make member ``name`` the leader (etcd's MoveLeader, asked of the current leader)."""
        members = self.members()
        target = next((m for m in members if m["name"] == name), None)
        leader = next((m for m in members if m["leader"]), None)
        if target is None or leader is None:
            raise EtcdStoreError(f"move leader to {name}: no such member or no leader ({members})")
        if target["leader"]:
            return
        session = self._clients[0].session
        try:
            resp = session.post(leader["client_urls"][0].rstrip("/") + "/v3/maintenance/transfer-leadership",
                                data=json.dumps({"targetID": target["id"]}), timeout=10 * self.request_seconds)
        except requests.exceptions.RequestException as exc:
            raise EtcdStoreError(f"move leader to {name}: {exc}") from None
        if resp.status_code != 200:
            raise EtcdStoreError(f"move leader to {name}: HTTP {resp.status_code} {resp.text[:200]}")

    def _status_of(self, url: str) -> dict[str, Any] | None:
        session = self._clients[0].session
        try:
            resp = session.post(url.rstrip("/") + "/v3/maintenance/status", data="{}", timeout=self.request_seconds)
        except requests.exceptions.RequestException:
            return None
        return resp.json() if resp.status_code == 200 else None

    def close(self) -> None:
        for c in self._clients:
            c.session.close()
