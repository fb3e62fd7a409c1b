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
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from sentinel.families import LabelKey, gauge

DEADLINE_SECONDS = 2.0
MEMBER_UP = gauge("sentinel_rendezvous_store_member_up",
                  "1 when this node reached the etcd member of the job's rendezvous at the last check", "member")
MEMBER_LEADER = gauge("sentinel_rendezvous_store_member_leader",
                      "1 for the member the reachable members name as the Raft leader", "member")


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
            self._context = ssl.create_default_context(cafile=cacert)
            if cert and key:
                self._context.load_cert_chain(cert, key)
        self._post = post or self._http_post
        self._last: dict[str, Any] = {"members": [], "leader": None, "checked_at": None, "error": "not checked yet"}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _http_post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=DEADLINE_SECONDS, context=self._context) as resp:
            return json.loads(resp.read(1 << 20))

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
        for m in listed.get("members", []):
            url = (m.get("clientURLs") or [""])[0]
            st = self._ask(url, "/v3/maintenance/status") if url else None
            if st is not None and st.get("leader"):
                leader_id = str(st["leader"])
            members.append({"id": str(m.get("ID", "")), "name": str(m.get("name", "")), "client_url": url,
                            "reachable": st is not None, "leader": False})
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
