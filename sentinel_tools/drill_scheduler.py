"""The drill's scheduler as a host of its own (``--hosts netns``): the daemons' spare calls go
over the bridge, as a real daemon's call to slurmctld or the Kubernetes API does.

``serve`` runs on the scheduler's host: an HTTP server on its bridge address that answers
``POST /claim`` by claiming a spare from the pool (:func:`sentinel_tools.drill_cluster.claim_spare`:
admit a warm one, or start a cold one). ``claim`` is the daemons' ``spare_command``: it posts
to the scheduler and prints its answer (the ``sentinel-spare-choice`` line included), exiting
with its status; a scheduler it cannot reach is a failure within ``--timeout`` seconds (a
partitioned host's daemon cannot ask for its own spare). Every request carries the job's token
(a file of the drill's, mode 0600): the bridge holds only the drill's hosts, but a request
without it is refused all the same.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import io
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_BODY = 4096


def _handler(pool: Path, topology: str, token: str) -> type[BaseHTTPRequestHandler]:
    class Claim(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/claim":
                return self._answer(404, {"error": "no such call"})
            if not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                return self._answer(403, {"error": "no valid token"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 <= length <= MAX_BODY:
                return self._answer(413, {"error": "body too large"})
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                departed = str(body.get("for", ""))
            except (ValueError, AttributeError):
                return self._answer(400, {"error": "the body is not a JSON object"})
            from sentinel_tools.drill_cluster import claim_spare

            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = claim_spare(pool, departed, topology)
            self._answer(200, {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            print(f"scheduler: {self.address_string()} {fmt % args}", file=sys.stderr, flush=True)

    return Claim


def serve(address: str, port: int, pool: Path, topology: str, token_file: Path) -> int:
    token = token_file.read_text().strip()
    server = ThreadingHTTPServer((address, port), _handler(pool, topology, token))
    print(f"scheduler listening on {address}:{port}", flush=True)
    server.serve_forever()
    return 0


def claim(url: str, departed: str, token_file: Path, timeout: float) -> int:
    req = urllib.request.Request(f"{url}/claim", data=json.dumps({"for": departed}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token_file.read_text().strip()}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read(1 << 20))
    except urllib.error.HTTPError as exc:
        print(f"the scheduler at {url} refused: {exc.code} {exc.read(300).decode(errors='replace')}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"the scheduler at {url} cannot be reached: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(answer.get("stdout", ""))
    sys.stderr.write(answer.get("stderr", ""))
    return int(answer.get("rc", 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel_tools.drill_scheduler")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--address", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--pool", type=Path, required=True)
    s.add_argument("--topology", default="")
    s.add_argument("--token-file", type=Path, required=True)
    c = sub.add_parser("claim")
    c.add_argument("--url", required=True)
    c.add_argument("--for", dest="departed", default="")
    c.add_argument("--token-file", type=Path, required=True)
    c.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return serve(args.address, args.port, args.pool, args.topology, args.token_file)
    return claim(args.url, args.departed, args.token_file, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
