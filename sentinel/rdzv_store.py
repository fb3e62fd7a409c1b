"""The job's etcd rendezvous as this node's daemon sees it: members, leader, reachability.

    [job]
    rendezvous_etcd_endpoints = ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"]
    rendezvous_etcd_cacert = "/run/sentinel/jobs/JOB/ca.pem"      # the job's CA (sentinel.etcd_pki)
    rendezvous_etcd_cert = "/run/sentinel/jobs/JOB/client.pem"    # a client certificate of that CA
    rendezvous_etcd_key = "/run/sentinel/jobs/JOB/client.key"

A thread of its own asks every ``rendezvous_check_seconds``: the member list (from any member that
answers) and each member's status (``/v3/maintenance/status``, which names the leader), each
request with a deadline of ``DEADLINE_SECONDS``; the loop only reads the last answer, so a member
that hangs never holds a poll. Shown in ``sentinel status`` (one line per member) and on
``/metrics`` (``sentinel_rendezvous_store_member_up{member}``,
``sentinel_rendezvous_store_member_leader{member}``; members' names are few and fixed per job).
Read only: the daemon never writes the rendezvous. Standard library only (no torch, no etcd client).

The member list comes from the job's etcd, which the job's user runs (and holds its members' keys):
it is untrusted. A member's client URL is asked only when it is ``http(s)://host:port`` in this
watch's scheme, with no path, query, fragment or user part (else, e.g. ``file:///root/x.json#``,
root would read a local file, or hang on a FIFO, for the user), redirects are not followed, at most
``MAX_MEMBERS`` members are kept, names are cut to printable characters, and each answer is read
within ``DEADLINE_SECONDS`` in all (a member that drips its answer is cut off).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterator

from sentinel.families import LabelKey, gauge

DEADLINE_SECONDS = 2.0
MAX_MEMBERS = 16  # etcd advises at most 7; a longer list is the job's store lying
MAX_ANSWER = 1 << 20
_NAME = re.compile(r"[^A-Za-z0-9_.:-]")
MEMBER_UP = gauge("sentinel_rendezvous_store_member_up",
                  "1 when this node reached the etcd member of the job's rendezvous at the last check", "member")
MEMBER_LEADER = gauge("sentinel_rendezvous_store_member_leader",
                      "1 for the member the reachable members name as the Raft leader", "member")


@contextlib.contextmanager
def _regular(path: str) -> Iterator[str]:
    """``path`` opened as a regular file (no FIFO, device or final symlink: the job's directory is
    its user's, and a FIFO there would hang the root daemon's start), as a ``/proc/self/fd`` path
    for ssl, which takes file names only."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ANSWER:
            raise OSError(f"{path}: not a regular file of at most {MAX_ANSWER} bytes")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A member answers itself: a redirect (to another host, or ftp://) is not followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        return None


class NullRendezvousStore:
    """No etcd rendezvous configured: nothing shown, nothing asked."""

    FAMILIES = ()

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any] | None:
        return None

    def gauges(self) -> dict[LabelKey, float]:
        return {}


class RendezvousStoreWatch:
    """Asks the job's etcd members, off the daemon's loop; :meth:`status` and :meth:`gauges` read
    the last answer. ``post`` (url, body) -> JSON is injectable for tests."""

    FAMILIES = (MEMBER_UP, MEMBER_LEADER)

    def __init__(self, endpoints: list[str], *, cacert: str = "", cert: str = "", key: str = "",
                 interval: float = 10.0, post: Callable[[str, dict], dict] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.endpoints = list(endpoints)
        self.scheme = "https" if cacert else "http"
        self.interval = interval
        self._clock = clock
        self._context: ssl.SSLContext | None = None
        if cacert:
            with _regular(cacert) as ca:
                self._context = ssl.create_default_context(cafile=ca)
            if cert and key:
                with _regular(cert) as c, _regular(key) as k:
                    self._context.load_cert_chain(c, k)
        self._post = post or self._http_post
        self._last: dict[str, Any] = {"members": [], "leader": None, "checked_at": None, "error": "not checked yet"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _http_post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=self._context))
        end = time.monotonic() + DEADLINE_SECONDS
        with opener.open(req, timeout=DEADLINE_SECONDS) as resp:
            data = b""
            while len(data) <= MAX_ANSWER:
                if time.monotonic() > end:
                    raise ValueError(f"{url}: no whole answer within {DEADLINE_SECONDS} s")
                chunk = resp.read1(65536)
                if not chunk:
                    return json.loads(data)
                data += chunk
            raise ValueError(f"{url}: answer over {MAX_ANSWER} bytes")

    def member_url(self, url: Any) -> str:
        """``url`` when it is ``<scheme>://host:port`` of this watch's scheme, else "" (not asked)."""
        if not isinstance(url, str) or len(url) > 256:
            return ""
        try:
            u = urllib.parse.urlsplit(url)
            port = u.port
        except ValueError:
            return ""
        if u.scheme != self.scheme or not u.hostname or port is None or u.username is not None \
                or u.path not in ("", "/") or u.query or u.fragment or "#" in url or "?" in url:
            return ""
        return url

    def _ask(self, url: str, path: str) -> dict | None:
        try:
            return self._post(url.rstrip("/") + path, {})
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def check(self) -> dict[str, Any]:
        """One look: the member list from the first endpoint that answers, then each member's status."""
        listed = None
        for ep in self.endpoints:
            listed = self._ask(f"{self.scheme}://{ep}", "/v3/cluster/member/list")
            if listed is not None:
                break
        if listed is None:
            return {"members": [{"name": ep, "client_url": f"{self.scheme}://{ep}", "reachable": False, "leader": False}
                                for ep in self.endpoints],
                    "leader": None, "checked_at": self._clock(), "error": "no member answered"}
        members, leader_id = [], None
        listed_members = listed.get("members") if isinstance(listed, dict) else None
        for m in (listed_members if isinstance(listed_members, list) else [])[:MAX_MEMBERS]:
            if not isinstance(m, dict):
                continue
            urls = m.get("clientURLs")
            url = self.member_url(urls[0] if isinstance(urls, list) and urls else "")
            st = self._ask(url, "/v3/maintenance/status") if url else None
            if isinstance(st, dict) and st.get("leader"):
                leader_id = str(st["leader"])[:32]
            members.append({"id": str(m.get("ID", ""))[:32], "name": _NAME.sub("?", str(m.get("name", ""))[:64]),
                            "client_url": url, "reachable": isinstance(st, dict), "leader": False})
        for m in members:
            m["leader"] = m["id"] == leader_id
        leader = next((m["name"] for m in members if m["leader"]), None)
        return {"members": members, "leader": leader, "checked_at": self._clock(), "error": None}

    def _run(self) -> None:
        while True:
            try:
                last = self.check()
            except Exception as exc:  # noqa: BLE001 - a watch thread never dies: said in the status
                last = {"members": [], "leader": None, "checked_at": self._clock(), "error": repr(exc)[:300]}
            with self._lock:
                self._last = last
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sentinel-rdzv-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._last)

    def gauges(self) -> dict[LabelKey, float]:
        out: dict[LabelKey, float] = {}
        for m in self.status()["members"]:
            out[MEMBER_UP.key(member=m["name"])] = 1.0 if m["reachable"] else 0.0
            out[MEMBER_LEADER.key(member=m["name"])] = 1.0 if m["leader"] else 0.0
        return out


def from_config(job: Any) -> NullRendezvousStore | RendezvousStoreWatch:
    if not job.rendezvous_etcd_endpoints:
        return NullRendezvousStore()
    return RendezvousStoreWatch(list(job.rendezvous_etcd_endpoints), cacert=job.rendezvous_etcd_cacert,
                                cert=job.rendezvous_etcd_cert, key=job.rendezvous_etcd_key,
                                interval=job.rendezvous_check_seconds)


def status_lines(store: dict[str, Any] | None) -> list[str]:
    """``sentinel status``: one line for the store, one per member."""
    if not store:
        return []
    lines = [f"rendezvous store (etcd): leader {store.get('leader') or 'none known'}"
             + (f"  ({store['error']})" if store.get("error") else "")]
    for m in store.get("members", []):
        state = "reachable" if m.get("reachable") else "UNREACHABLE"
        lines.append(f"  {m.get('name', '?'):<12} {m.get('client_url', ''):<28} {state}"
                     + ("  leader" if m.get("leader") else ""))
    return lines
