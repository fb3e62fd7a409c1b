"""Hang verdicts between the job's daemons: a verdict that names another node reaches that
node's daemon, whichever ranks are alive.

The job's ranks decide a hang verdict among themselves (:mod:`trainer.progress`) and each live
rank reports it to *its own* daemon. When every rank of the culprit's node is stuck (a GPU hang
that takes the whole node), no report reaches the culprit's daemon, and the daemons that hear
the verdict must not act on another node themselves. So a daemon that hears a decided verdict
naming other nodes forwards it, as one UDP datagram, to each named node's daemon; that daemon
treats it as a report of its own ranks (:mod:`sentinel.jobhealth`: rule ``hang``, action
``migrate``), and hands its node over through its own backend and breaker.

Trust: a datagram is acted on only when its HMAC-SHA256 under the job's key verifies (a file
owned by root, readable by nobody else, the same on every node of the job: ``[job]
peer_key_file``), it names this node as the recipient, its time is within ``FRESH_SECONDS`` of
this daemon's clock, and its nonce was not seen before. The peers' addresses come from ``[job]
peers_file`` (JSON: node name -> ``"address:port"``), read at each forward. With no key file
configured, :class:`NullPeers` stands in: verdicts stay on the node that heard them.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable

from sentinel.channel import Report
from sentinel.log import event
from sentinel.settings import parse_address

log = logging.getLogger("sentinel.peers")

VERSION = 1
MAX_DATAGRAM = 4096
FRESH_SECONDS = 30.0
DECIDED = ("stopped", "not_entered", "behind")  # the verdict kinds sentinel.jobhealth acts on
MAX_MESSAGES_PER_POLL = 64


class PeerError(ValueError):
    """A datagram that must not be acted on; the message says why."""


def read_key(path: str | os.PathLike) -> bytes:
    """The job's key: a regular file owned by root and readable by nobody else, 16 bytes at least."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise PeerError(f"{path}: the peer key must be a regular file of root's, mode 0600 or stricter")
        key = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(key) < 16:
        raise PeerError(f"{path}: the peer key is shorter than 16 bytes")
    return key


def sign(key: bytes, body: dict[str, Any]) -> bytes:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    mac = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"body": text, "mac": mac}, separators=(",", ":")).encode()


def verify(key: bytes, data: bytes, *, node: str, now: float, seen: dict[str, float]) -> dict[str, Any]:
    """The datagram's body, or PeerError. ``seen`` (nonce -> time) is the caller's replay memory."""
    if len(data) > MAX_DATAGRAM:
        raise PeerError("datagram too large")
    try:
        outer = json.loads(data)
        text, mac = outer["body"], outer["mac"]
        if not isinstance(text, str) or not isinstance(mac, str):
            raise TypeError("body and mac must be strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise PeerError(f"not a peer message ({exc})") from None
    want = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, mac):
        raise PeerError("bad MAC: not signed with this job's key")
    body = json.loads(text)
    if body.get("v") != VERSION or body.get("kind") != "hang" or not isinstance(body.get("verdict"), dict):
        raise PeerError("unknown message")
    if body.get("to") != node:
        raise PeerError(f"addressed to {body.get('to')!r}, not this node")
    sent = body.get("time")
    if not isinstance(sent, (int, float)) or abs(now - sent) > FRESH_SECONDS:
        raise PeerError("stale or from the future")
    nonce = body.get("nonce")
    if not isinstance(nonce, str) or nonce in seen:
        raise PeerError("replayed")
    for old in [n for n, t in seen.items() if now - t > 2 * FRESH_SECONDS]:
        del seen[old]
    seen[nonce] = now
    return body


class NullPeers:
    """No peer key configured: verdicts stay where they were heard. Costs nothing."""

    def forward(self, report: Any) -> list[str]:
        return []

    def receive(self) -> list[Report]:
        return []

    def close(self) -> None:
        return None


class Peers:
    def __init__(self, node: str, key: bytes, listen: tuple[str, int], peers_file: Path, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.node, self.key, self.peers_file, self.clock = node, key, peers_file, clock
        self.sock = socket.socket(socket.AF_INET6 if ":" in listen[0] else socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind(listen)
        self.seen: dict[str, float] = {}

    def _peers(self) -> dict[str, tuple[str, int]]:
        try:
            table = json.loads(self.peers_file.read_text())
            return {str(n): parse_address(str(a)) for n, a in table.items()}
        except (OSError, ValueError, AttributeError) as exc:
            event(log, "peers file unreadable: verdicts are not forwarded", logging.WARNING, path=str(self.peers_file),
                  error=str(exc))
            return {}

    def forward(self, report: Any) -> list[str]:
        """Send a decided hang verdict that names other nodes to each of their daemons."""
        d = report.detail
        hosts = [h for h in d.get("hosts", []) if isinstance(h, str) and h != self.node]
        if report.kind != "hang" or d.get("kind") not in DECIDED or not hosts:
            return []
        peers, sent = self._peers(), []
        for host in hosts:
            if host not in peers:
                event(log, "no address for the culprit's daemon: verdict not forwarded", logging.WARNING, node=host)
                continue
            body = {"v": VERSION, "kind": "hang", "from": self.node, "to": host, "time": self.clock(),
                    "nonce": os.urandom(12).hex(), "rank": report.rank, "step": report.step,
                    "verdict": {k: d.get(k) for k in ("kind", "culprits", "hosts", "evidence")}}
            try:
                self.sock.sendto(sign(self.key, body)[:MAX_DATAGRAM], peers[host])
                sent.append(host)
            except OSError as exc:
                event(log, "verdict not forwarded", logging.WARNING, node=host, error=str(exc))
        if sent:
            event(log, "hang verdict forwarded to the culprit's daemon", logging.WARNING, to=sent, step=report.step)
        return sent

    def receive(self) -> list[Report]:
        """The verdicts other daemons forwarded since the last poll, as reports of this node's ranks."""
        out = []
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                data, addr = self.sock.recvfrom(MAX_DATAGRAM + 1)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.ECONNREFUSED):
                    break
                raise
            try:
                body = verify(self.key, data, node=self.node, now=self.clock(), seen=self.seen)
            except PeerError as exc:
                event(log, "peer message refused", logging.WARNING, sender=str(addr[0]), why=str(exc))
                continue
            v = body["verdict"]
            detail = {"kind": v.get("kind"), "culprits": v.get("culprits") or [], "hosts": v.get("hosts") or [],
                      "evidence": f"forwarded by {body.get('from')}'s daemon: {v.get('evidence') or ''}"[:400]}
            rank, step = body.get("rank"), body.get("step")
            out.append(Report("hang", rank if isinstance(rank, int) else -1, step if isinstance(step, int) else -1,
                              detail))
        return out

    def close(self) -> None:
        self.sock.close()


def from_config(node: str, job: Any) -> NullPeers | Peers:
    """The configured peers (``[job] peer_key_file``), or NullPeers when none is configured."""
    if not job.peer_key_file:
        return NullPeers()
    return Peers(node, read_key(job.peer_key_file), parse_address(job.peer_listen_address), Path(job.peers_file))
