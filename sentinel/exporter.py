"""The metrics endpoint: the exposition is rendered at most once per published view, and only when scraped.

:meth:`MetricsServer.refresh` collects the registry once, renders the text format (sentinel/exposition.py),
swaps the result in with one attribute assignment. After the daemon publishes a new (immutable)
:class:`~sentinel.metrics.View` it calls :meth:`MetricsServer.invalidate`: the first scrape that
follows renders that view, once for every scraper, so a daemon polling at 1 Hz and scraped every
15 s renders once in 15 polls, and never on the poll loop (bench/poll_overhead.py). OpenMetrics
and gzip bodies are made from the same snapshot on first demand, cached until the next render.

Failure contract:

* A collector that raises during a render never fails a scrape: the previous samples are served
  and ``sentinel_exporter_render_failures_total`` (in the same exposition) counts the failure.
* A client that stalls (slow TLS handshake, a request trickled byte by byte, a reader that never
  drains) is cut off after ``timeout_seconds`` in total; connections past ``max_connections`` are
  closed at once and counted: neither can hold the poll loop or the other scrapers.

Security (docs/security.md): it binds ``metrics.listen_address`` (0.0.0.0 by default); with
``tls_cert_file``/``tls_key_file`` HTTPS only (TLS 1.2+), with ``tls_client_ca_file`` mTLS, with
``basic_auth_users_file`` basic auth on every path (lines from ``python -m sentinel.exporter
hash-password USER``; :mod:`sentinel.httpauth`). Alone: ``python -m sentinel.exporter serve --simulate gpus.json``.
"""

from __future__ import annotations

import argparse
import errno
import getpass
import gzip
import logging
import socket
import socketserver
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as CONTENT_TYPE_OPENMETRICS
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from sentinel.httpauth import (  # noqa: F401 - re-exported: the auth API's old home
    DEFAULT_ITERATIONS, MIN_ITERATIONS, PBKDF2_SCHEME, BasicAuth, UsersFileError, build_tls_context, hash_password, load_users)
from sentinel.exposition import Snapshot, TextRenderer
from sentinel.families import counter, gauge
from sentinel.log import event
from sentinel.metrics import View, build_registry, new_metric

log = logging.getLogger("sentinel.exporter")

TEXT = "text"
OPENMETRICS = "openmetrics"
_CONTENT_TYPES = {TEXT: CONTENT_TYPE_PLAIN_0_0_4, OPENMETRICS: CONTENT_TYPE_OPENMETRICS}
_REALM = 'Basic realm="sentinel", charset="UTF-8"'
_INDEX = (b"<html><head><title>Sentinel</title></head><body><h1>Sentinel GPU health exporter</h1>"
          b"<p><a href=\"/metrics\">/metrics</a> &middot; <a href=\"/livez\">/livez</a> &middot; <a href=\"/readyz\">/readyz</a></p></body></html>\n")


# The server's own families, rendered after the registry's.
RENDER_FAILURES = counter("sentinel_exporter_render_failures", "Renders that raised (scrapes kept the last)")
RENDER_DURATION = gauge("sentinel_exporter_render_duration_seconds", "Duration of the last render")
REJECTED_CONNECTIONS = counter("sentinel_exporter_rejected_connections", "Scrape connections refused or cut, by reason", "reason")
FAMILIES = (RENDER_FAILURES, RENDER_DURATION, REJECTED_CONNECTIONS)


# -- content negotiation ------------------------------------------------------------------------
def _media_ranges(header: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for item in header.split(","):
        media, *params = [p.strip() for p in item.split(";")]
        if not media:
            continue
        opts = {}
        for p in params:
            k, _, v = p.partition("=")
            opts[k.strip().lower()] = v.strip().strip('"')
        try:
            q = float(opts.pop("q", "1"))
        except ValueError:
            q = 0.0
        out.append((media.lower(), opts, q))
    return out


def negotiate_format(accept: str | None) -> str:
    """TEXT (Prometheus text 0.0.4) or OPENMETRICS (1.0.0), by the client's Accept header.

    OpenMetrics is chosen only when asked for (with no version or version 1.x) at a quality no
    lower than any text/plain or */* range, as Prometheus' default Accept header does.
    """
    best_om = best_text = -1.0
    for media, opts, q in _media_ranges(accept or ""):
        if q <= 0:
            continue
        if media == "application/openmetrics-text" and opts.get("version", "1.0.0").startswith("1."):
            best_om = max(best_om, q)
        elif media in ("text/plain", "text/*", "*/*"):
            best_text = max(best_text, q)
    return OPENMETRICS if best_om >= 0 and best_om >= best_text else TEXT


def gzip_accepted(accept_encoding: str | None) -> bool:
    return any(media in ("gzip", "x-gzip") and q > 0 for media, _, q in _media_ranges(accept_encoding or ""))


# -- one rendered snapshot ----------------------------------------------------------------------
class _Exposition:
    """The bodies of one refresh. ``text`` is rendered eagerly; the rest on first demand, once."""

    def __init__(self, families: list[Metric], text: bytes, on_render_failure: Callable[[str, BaseException], None]) -> None:
        self.families = Snapshot(families)
        # (asked format, gzip?) -> (format served, body)
        self._bodies: dict[tuple[str, bool], tuple[str, bytes]] = {(TEXT, False): (TEXT, text)}
        self._lock = threading.Lock()
        self._on_render_failure = on_render_failure

    def body(self, fmt: str, compress: bool) -> tuple[str, bytes]:
        """(format served, bytes). An OpenMetrics render that fails is counted and text is served."""
        hit = self._bodies.get((fmt, compress))
        if hit is not None:
            return hit
        with self._lock:  # concurrent scrapers wait for one render instead of each doing it
            hit = self._bodies.get((fmt, compress))
            if hit is None:
                if (fmt, False) not in self._bodies:
                    try:
                        self._bodies[(fmt, False)] = (fmt, generate_openmetrics(self.families))
                    except Exception as exc:  # noqa: BLE001 - an encoder bug must not fail the scrape
                        self._on_render_failure(fmt, exc)
                        self._bodies[(fmt, False)] = self._bodies[(TEXT, False)]
                served, plain = self._bodies[(fmt, False)]
                hit = (served, gzip.compress(plain, compresslevel=6)) if compress else (served, plain)
                self._bodies[(fmt, compress)] = hit
        return hit


# -- the server ---------------------------------------------------------------------------------
@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # close() cuts live connections itself; never wait on a stuck client
    request_queue_size = 128  # socketserver's default of 5 drops SYNs when 20 scrapers connect at once

    def __init__(self, address: tuple[str, int], family: int, owner: "MetricsServer") -> None:
        self.address_family = family
        self.owner = owner
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN (a DNS lookup at start); not needed.
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self.owner._slots.acquire(blocking=False):
            self.owner._reject("connection_limit")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.owner._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        owner = self.owner
        conn = owner._track(request)
        try:
            request.settimeout(owner.timeout_seconds)
            if owner._tls is not None:
                tls = owner._tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                with conn.lock:
                    conn.sock = request = tls
                tls.do_handshake()
            self.finish_request(request, client_address)
        except ssl.SSLError as exc:
            owner._reject("tls_error")
            event(log, "metrics client failed TLS (handshake, certificate or protocol)", logging.DEBUG, client=client_address[0], error=str(exc))
        except OSError as exc:  # reset, broken pipe, a timeout (counted below), or cut by the reaper
            event(log, "metrics connection ended early", logging.DEBUG, client=client_address[0], error=str(exc))
        except Exception:  # noqa: BLE001 - a bug in one request must not end the server; log it loudly
            log.exception("metrics request failed", extra={"fields": {"client": client_address[0]}})
        finally:
            with conn.lock:
                conn.closed = True
                self.shutdown_request(request)
            owner._untrack(conn)
            owner._slots.release()
            # Whichever noticed first (the socket timeout, which the request handler swallows, or
            # the reaper), a connection still open at its deadline is counted once, here.
            if owner.clock() >= conn.deadline:
                owner._reject("timeout")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.0"  # one request per connection: a connection's lifetime is bounded

    def version_string(self) -> str:  # the Server header: no Python version for scanners
        return "sentinel"

    def do_GET(self) -> None:
        self._respond(head=False)

    def do_HEAD(self) -> None:
        self._respond(head=True)

    def _respond(self, *, head: bool) -> None:
        owner = self.server.owner
        path = urlsplit(self.path).path
        if path in ("/livez", "/readyz", "/healthz"):  # probes carry no credentials; they say ok or stuck only
            live, ready, line = owner.health()
            ok = ready if path == "/readyz" else live
            self._send(200 if ok else 503, "text/plain; charset=utf-8", (line + "\n").encode(), head)
            return
        if owner._auth is not None and owner._auth.check(self.headers.get("Authorization")) is None:
            owner._reject("unauthorized")
            self._send(401, "text/plain; charset=utf-8", b"401 Unauthorized\n", head, [("WWW-Authenticate", _REALM)])
            return
        if path == "/metrics":
            fmt = negotiate_format(self.headers.get("Accept"))
            compress = gzip_accepted(self.headers.get("Accept-Encoding"))
            fmt, body = owner.current().body(fmt, compress)
            extra = [("Vary", "Accept, Accept-Encoding")]
            if compress:
                extra.append(("Content-Encoding", "gzip"))
            self._send(200, _CONTENT_TYPES[fmt], body, head, extra)
        elif path == "/":
            self._send(200, "text/html; charset=utf-8", _INDEX, head)
        else:
            self._send(404, "text/plain; charset=utf-8", b"404 Not Found: try /metrics\n", head)

    def _send(self, code: int, content_type: str, body: bytes, head: bool, extra: list[tuple[str, str]] = ()) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if log.isEnabledFor(logging.DEBUG):  # called for every request: format only when kept
            event(log, "metrics request", logging.DEBUG, client=self.client_address[0], line=format % args)


class MetricsServer:
    """Serves ``/metrics`` (plus ``/``) from bytes rendered by :meth:`refresh`, and the probes.

    ``/livez`` (and its old name ``/healthz``) and ``/readyz`` answer what ``health`` says
    (``(live, ready, line)``: 200 or 503 with the line); they need no credentials, as kubelet
    probes carry none, and say nothing but ok or stuck. Without ``health`` they answer ok.

    ``registry`` is anything with ``collect()`` (a CollectorRegistry). Nothing listens until
    :meth:`start`; :meth:`refresh` (render now) and :meth:`invalidate` (render at the next scrape)
    may be called before or after. Thread-safe: :meth:`invalidate` runs on the poll loop, the
    renders it asks for on the server's threads.
    """

    def __init__(
        self,
        registry: Collector,
        *,
        listen_address: str = "0.0.0.0",
        port: int = 9477,
        tls_cert_file: str = "",
        tls_key_file: str = "",
        tls_client_ca_file: str = "",
        basic_auth_users_file: str = "",
        timeout_seconds: float = 10.0,
        max_connections: int = 64,
        clock: Callable[[], float] = time.monotonic,
        health: Callable[[], tuple[bool, bool, str]] | None = None,
    ) -> None:
        if bool(tls_cert_file) != bool(tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if tls_client_ca_file and not tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        self.registry = registry
        self.listen_address = listen_address
        self.requested_port = port
        self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file = tls_cert_file, tls_key_file, tls_client_ca_file
        self.basic_auth_users_file = basic_auth_users_file
        self.timeout_seconds = timeout_seconds
        self.max_connections = max_connections
        self.clock = clock
        self.health = health or (lambda: (True, True, "ok"))
        self._tls: ssl.SSLContext | None = None
        self._auth: BasicAuth | None = None
        self._httpd: _HTTPServer | None = None
        self._port: int | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._conns: dict[int, _Conn] = {}
        self._conns_lock = threading.Lock()
        self._busy = threading.Event()  # set while connections are open (and at close): wakes the reaper
        self._render_lock = threading.Lock()
        self._text = TextRenderer()  # the text format, as prometheus_client renders it
        self._stats_lock = threading.Lock()
        self._render_failures = 0
        self._render_seconds: float | None = None
        self._rejected: dict[str, int] = {}
        self._last_good: list[Metric] = []
        self._current = _Exposition([], b"", self._format_failed)
        self._stale, self._lazy_lock = False, threading.Lock()  # a view published since the last render

    @classmethod
    def from_config(cls, registry: Collector, metrics: Any, **kwargs: Any) -> "MetricsServer":
        """From a :class:`sentinel.config.MetricsConfig`."""
        return cls(registry, listen_address=metrics.listen_address, port=metrics.port,
                   tls_cert_file=metrics.tls_cert_file, tls_key_file=metrics.tls_key_file,
                   tls_client_ca_file=metrics.tls_client_ca_file,
                   basic_auth_users_file=metrics.basic_auth_users_file, **kwargs)

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The bound port (the real one when started with port 0)."""
        if self._port is None:
            raise RuntimeError("MetricsServer is not started")
        return self._port

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_file else "http"

    def start(self) -> None:
        """Load TLS and auth files, bind, and serve on background (daemon) threads.

        Raises OSError whose ``strerror`` is one clear sentence: a file that cannot be used, or an
        address that cannot be bound (in use, not local, not permitted).
        """
        if self.tls_cert_file:
            try:
                self._tls = build_tls_context(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise OSError(getattr(exc, "errno", None) or errno.EINVAL,
                              f"cannot load the metrics TLS certificate {self.tls_cert_file} / key {self.tls_key_file}"
                              f"{' / client CA ' + self.tls_client_ca_file if self.tls_client_ca_file else ''}: "
                              f"{exc.strerror or exc}") from None
        if self.basic_auth_users_file:
            try:
                self._auth = BasicAuth(load_users(self.basic_auth_users_file))
            except UsersFileError as exc:
                raise OSError(errno.EINVAL, f"cannot use the metrics basic-auth users file: {exc}") from None
            if self._tls is None:
                event(log, "metrics basic auth is on without TLS: passwords cross the network in clear text",
                      logging.WARNING, listen_address=self.listen_address)
        where = f"{self.listen_address}:{self.requested_port}"
        try:
            infos = socket.getaddrinfo(self.listen_address or None, self.requested_port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = infos[0]
            self._httpd = _HTTPServer((sockaddr[0], sockaddr[1]), family, self)
        except socket.gaierror as exc:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen for metrics on {where}: {exc.strerror}") from None
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for metrics on {where}: {exc.strerror}") from None
        self._port = self._httpd.server_port
        if self._render_seconds is None:  # nothing refreshed yet: serve sentinel_up rather than nothing
            self.refresh()
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                             name="sentinel-metrics", daemon=True),
            threading.Thread(target=self._reap, name="sentinel-metrics-reaper", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop listening and cut every open connection; returns within about a second."""
        self._stop.set()
        with self._conns_lock:  # as the reaper decides to sleep: it never sleeps past close
            self._busy.set()
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:
            self._cut(conn)
        for t in self._threads:
            t.join(timeout=2.0)

    # -- rendering ------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Collect the registry once, render the text format, and swap it in for scrapes.

        Returns False when the collector (or the render) raised: scrapes then keep the previous
        samples, with ``sentinel_exporter_render_failures_total`` counting the failure.
        """
        with self._render_lock:
            t0 = time.perf_counter()
            ok = True
            try:
                families = list(self.registry.collect())
            except Exception as exc:  # noqa: BLE001 - a collector bug must never fail a scrape
                ok = False
                families = self._last_good
                self._count_render_failure("collect", exc)
            try:
                text = self._text.render(families + self._own_families())
            except Exception as exc:  # noqa: BLE001 - e.g. a sample the encoder rejects
                self._count_render_failure("text", exc)
                return False
            if ok:
                self._last_good = families
            self._current = _Exposition(families + self._own_families(), text, self._format_failed)
            self._render_seconds = time.perf_counter() - t0
            return ok

    def invalidate(self) -> None:
        """A new view was published: the next scrape renders it (costs the caller nothing)."""
        self._stale = True

    def current(self) -> _Exposition:
        """What a scrape serves: rendered now (by one scraper; the others wait) if stale."""
        if self._stale:
            with self._lazy_lock:
                if self._stale:
                    self._stale = False  # first: a view published during the render marks it stale again
                    self.refresh()
        return self._current

    def exposition(self, fmt: str = TEXT) -> bytes:
        """The bytes a scrape in ``fmt`` gets now (uncompressed)."""
        return self.current().body(fmt, False)[1]

    def _own_families(self) -> list[Metric]:
        fails = new_metric(RENDER_FAILURES)
        fails.add_metric([], float(self._render_failures))
        out: list[Metric] = [fails]
        if self._render_seconds is not None:
            dur = new_metric(RENDER_DURATION)
            dur.add_metric([], self._render_seconds)
            out.append(dur)
        rejected = new_metric(REJECTED_CONNECTIONS)
        with self._stats_lock:
            for reason, n in sorted(self._rejected.items()):
                rejected.add_metric([reason], float(n))
        out.append(rejected)
        return out

    def _count_render_failure(self, stage: str, exc: BaseException) -> None:
        with self._stats_lock:
            self._render_failures += 1
        event(log, "metrics render failed; scrapes keep the previous samples", logging.ERROR,
              stage=stage, error=f"{type(exc).__name__}: {exc}", failures=self._render_failures)

    def _format_failed(self, fmt: str, exc: BaseException) -> None:
        with self._stats_lock:
            self._render_failures += 1
        event(log, "metrics render failed; serving the text format instead", logging.ERROR,
              format=fmt, error=f"{type(exc).__name__}: {exc}")

    # -- connections ----------------------------------------------------------------------------
    def _reject(self, reason: str) -> None:
        with self._stats_lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _track(self, sock: socket.socket) -> _Conn:
        conn = _Conn(sock, self.clock() + self.timeout_seconds)
        with self._conns_lock:
            self._conns[id(conn)] = conn
        self._busy.set()  # the reaper watches while connections are open, and sleeps otherwise
        return conn

    def _untrack(self, conn: _Conn) -> None:
        with self._conns_lock:
            self._conns.pop(id(conn), None)

    @staticmethod
    def _cut(conn: _Conn) -> None:
        with conn.lock:  # never shut down an fd the handler already closed (and the kernel reused)
            if conn.closed:
                return
            try:
                socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
            except OSError:
                return  # the peer already went away

    def _reap(self) -> None:
        """Cut connections past their deadline (a socket timeout alone lets a client that trickles a
        byte per interval hold a thread for ever); asleep while none is open."""
        interval = min(0.25, self.timeout_seconds / 4)
        while not self._stop.is_set():
            with self._conns_lock:
                if not self._conns and not self._stop.is_set():  # no wake-ups until a connection (or close)
                    self._busy.clear()
            if not self._busy.is_set():
                self._busy.wait()
            elif not self._stop.wait(interval):
                now = self.clock()
                with self._conns_lock:
                    late = [c for c in self._conns.values() if now >= c.deadline and not c.closed]
                for conn in late:
                    self._cut(conn)


# -- command line -------------------------------------------------------------------------------
def _cmd_hash_password(args: argparse.Namespace) -> int:
    if ":" in args.user or not args.user:
        print("hash-password: a user name must be non-empty and contain no ':'", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {args.user}: ")
        if getpass.getpass("again: ") != password:
            print("hash-password: the passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("hash-password: empty password", file=sys.stderr)
        return 1
    print(f"{args.user}:{hash_password(password, iterations=args.iterations)}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve a simulated node's metrics, refreshed every second (for trying TLS/auth settings)."""
    from sentinel.readings import NodeReadings
    from sentinel.sources.nvml import NvmlSource
    from sentinel.sources.simulated import SimulatedNvml

    source = NvmlSource(SimulatedNvml(args.simulate))
    source.start()
    view = View()
    server = MetricsServer(build_registry(lambda: view), listen_address=args.listen_address, port=args.port,
                           tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file,
                           tls_client_ca_file=args.tls_client_ca_file, basic_auth_users_file=args.basic_auth_users_file)
    try:
        server.start()
    except OSError as exc:
        print(f"serve: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"serving {server.scheme}://{args.listen_address}:{server.port}/metrics", flush=True)
    try:
        while True:
            gpus = tuple(source.poll())
            view = View(NodeReadings(time=time.time(), driver_version=source.driver_version, gpus=gpus))
            server.refresh()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
        source.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sentinel.exporter", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    hp = sub.add_parser("hash-password", help="print a basic_auth_users_file line; the password is read from stdin")
    hp.add_argument("user")
    hp.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                    help=f"PBKDF2 iterations (default {DEFAULT_ITERATIONS}; minimum {MIN_ITERATIONS})")
    hp.set_defaults(func=_cmd_hash_password)
    sv = sub.add_parser("serve", help="serve simulated GPUs' metrics through this server, for trying settings")
    sv.add_argument("--simulate", required=True, help="state file from `sentinel simulate init`")
    sv.add_argument("--listen-address", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=0)
    sv.add_argument("--tls-cert-file", default="")
    sv.add_argument("--tls-key-file", default="")
    sv.add_argument("--tls-client-ca-file", default="")
    sv.add_argument("--basic-auth-users-file", default="")
    sv.set_defaults(func=_cmd_serve)
    args = parser.parse_args(argv)
    if getattr(args, "iterations", DEFAULT_ITERATIONS) < MIN_ITERATIONS:
        parser.error(f"--iterations must be >= {MIN_ITERATIONS}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
