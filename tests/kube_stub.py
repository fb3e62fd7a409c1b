"""A fake Kubernetes API server on loopback that answers badly or slowly: Nodes, a NodeList whose
items may lack ``spec``, access reviews that may lack ``status``, the breaker's Lease, and a
"drip" mode that sends every answer one byte at a time."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def node(name: str, rv: str = "1") -> dict:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "resourceVersion": rv},
            "spec": {}, "status": {"conditions": []}}


class KubeStub:
    def __init__(self, nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4")) -> None:
        self.nodes = {n: node(n) for n in nodes}
        self.node_list_items: list[dict] | None = None  # None: the nodes above
        self.review: dict = {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                             "status": {"allowed": True}}
        self.lease: dict | None = None
        self.drip_seconds = 0.0  # > 0: every answer goes out one byte per this many seconds
        self.endless = False  # with drip_seconds: the body never ends (a space at a time, until stop())
        self.requests: list[tuple[str, str]] = []
        self.stopping = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _answer(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                head = (f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                        ).encode()
                if stub.drip_seconds <= 0:
                    self.wfile.write(head + data)
                    return
                if stub.endless:  # a Content-Length it never reaches: spaces after the JSON, forever
                    head = head.replace(f"Content-Length: {len(data)}".encode(), b"Content-Length: 1073741824")
                payload = head + data
                i = 0
                while i < len(payload) or stub.endless:
                    if stub.stopping.wait(stub.drip_seconds):
                        return
                    try:
                        self.wfile.write(payload[i:i + 1] if i < len(payload) else b" ")
                        self.wfile.flush()
                    except OSError:
                        return
                    i += 1

            def _route(self, method: str) -> None:
                body = self._body()
                path = self.path.split("?")[0]
                stub.requests.append((method, path))
                parts = path.strip("/").split("/")
                if path == "/api/v1/nodes" and method == "GET":
                    items = stub.node_list_items if stub.node_list_items is not None else list(stub.nodes.values())
                    return self._answer(200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": items})
                if parts[:3] == ["api", "v1", "nodes"] and len(parts) >= 4:
                    n = stub.nodes.get(parts[3])
                    if n is None:
                        return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    if method == "PATCH":
                        rv = str(int(n["metadata"]["resourceVersion"]) + 1)
                        n["metadata"]["resourceVersion"] = rv
                        if len(parts) == 4:
                            for op in json.loads(body or b"[]"):
                                if op.get("path") == "/spec/unschedulable":
                                    n["spec"]["unschedulable"] = op.get("value", False) if op["op"] != "remove" else False
                    return self._answer(200, n)
                if path.endswith("/selfsubjectaccessreviews") and method == "POST":
                    return self._answer(201, {"spec": json.loads(body or b"{}").get("spec", {}), **stub.review})
                if "leases" in parts:
                    if method == "GET":
                        if stub.lease is None:
                            return self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                        return self._answer(200, stub.lease)
                    lease = json.loads(body)
                    lease.setdefault("metadata", {})["resourceVersion"] = str(time.monotonic_ns())
                    stub.lease = {"kind": "Lease", "apiVersion": "coordination.k8s.io/v1", **lease}
                    return self._answer(201 if method == "POST" else 200, stub.lease)
                return self._answer(404, {"kind": "Status", "code": 404})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

            def do_PATCH(self):
                self._route("PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}]}))
        return path

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
