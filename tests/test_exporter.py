"""The metrics endpoint: cached exposition, failure isolation, TLS, mTLS, basic auth, gzip, deadlines."""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.registry import CollectorRegistry

from conftest import REPO, metric_value, wait_for
from sentinel import config
from sentinel.exporter import BasicAuth, MetricsServer, UsersFileError, hash_password, load_users
from sentinel.metrics import SentinelCollector, View
from sentinel.readings import GpuReading, NodeReadings

OPENMETRICS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                      "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.x sends


def view(temperature: float, gpus: int = 2) -> View:
    readings = NodeReadings(time=0.0, driver_version="550.90.07", gpus=tuple(
        GpuReading(i, f"GPU-{i}", f"00000000:{0x18 + i:02X}:00.0", name="H100", serial=f"S{i}",
                   values={"temperature_celsius": temperature + i, "ecc_corrected_volatile": 3.0})
        for i in range(gpus)))
    return View(readings, health={i: 0 for i in range(gpus)})


class Node:
    """What the daemon owns: a current View, and a collector that can be made to fail."""

    def __init__(self) -> None:
        self.view = view(40.0)
        self.fail: Exception | None = None

    def current(self) -> View:
        if self.fail is not None:
            raise self.fail
        return self.view


@pytest.fixture
def node() -> Node:
    return Node()


@pytest.fixture
def serve(node):
    servers: list[MetricsServer] = []

    def start(**kwargs) -> MetricsServer:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SentinelCollector(node.current))
        server = MetricsServer(registry, listen_address="127.0.0.1", port=0, **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.close()


def get(server: MetricsServer, path: str = "/metrics", headers: dict | None = None, context: ssl.SSLContext | None = None,
        timeout: float = 5.0) -> tuple[int, dict, bytes]:
    cls = http.client.HTTPSConnection if context is not None else http.client.HTTPConnection
    kwargs = {"context": context} if context is not None else {}
    conn = cls("127.0.0.1", server.port, timeout=timeout, **kwargs)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def temperature(body: bytes, gpu: str = "0") -> float | None:
    return metric_value(body.decode(), "sentinel_gpu_temperature_celsius", gpu=gpu)


# -- rendering once per refresh -----------------------------------------------------------------
def test_scrape_serves_the_bytes_of_the_last_refresh(serve, node):
    server = serve()
    node.view = view(41.0)
    assert server.refresh() is True
    status, headers, first = get(server)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert first == server.exposition() and temperature(first) == 41.0
    node.view = view(77.0)  # published but not refreshed: scrapes must not run the collector
    assert get(server)[2] == first
    server.refresh()
    _, _, second = get(server)
    assert temperature(second) == 77.0 and temperature(second, gpu="1") == 78.0
    assert metric_value(second.decode(), "sentinel_exporter_render_failures_total") == 0


def test_raising_collector_keeps_previous_samples_and_is_counted(serve, node):
    server = serve()
    node.view = view(52.0)
    server.refresh()
    before = get(server)[2].decode()
    node.fail = RuntimeError("collector bug")
    assert server.refresh() is False
    assert server.refresh() is False
    status, _, after = get(server)
    assert status == 200
    text = after.decode()
    assert metric_value(text, "sentinel_exporter_render_failures_total") == 2
    gpu_lines = lambda t: [ln for ln in t.splitlines() if ln.startswith("sentinel_gpu_")]  # noqa: E731
    assert gpu_lines(text) == gpu_lines(before) and temperature(after) == 52.0
    node.fail = None
    node.view = view(60.0)
    assert server.refresh() is True
    assert temperature(get(server)[2]) == 60.0


def test_served_exposition_passes_promtool(serve):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    server = serve()
    server.refresh()
    r = subprocess.run([promtool, "check", "metrics"], input=get(server)[2], capture_output=True, timeout=30)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_openmetrics_when_asked_and_gzip_when_accepted(serve, node):
    server = serve()
    node.view = view(45.0)
    server.refresh()
    status, headers, body = get(server, headers={"Accept": OPENMETRICS_ACCEPT})
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    families = {f.name: f for f in parse_openmetrics(body.decode())}
    assert families["sentinel_gpu_temperature_celsius"].samples[0].value == 45.0
    status, headers, zipped = get(server, headers={"Accept-Encoding": "gzip, deflate"})
    assert headers["content-encoding"] == "gzip" and gzip.decompress(zipped) == get(server)[2]
    status, headers, zipped = get(server, headers={"Accept": OPENMETRICS_ACCEPT, "Accept-Encoding": "gzip"})
    assert gzip.decompress(zipped) == body
    # a client that ranks text/plain first gets text
    _, headers, _ = get(server, headers={"Accept": "text/plain;q=0.9,application/openmetrics-text;q=0.5"})
    assert headers["content-type"].startswith("text/plain")
    _, headers, _ = get(server, headers={"Accept-Encoding": "gzip;q=0"})
    assert "content-encoding" not in headers


def test_index_healthz_and_unknown_paths(serve):
    server = serve()
    status, headers, body = get(server, "/")
    assert status == 200 and b'href="/metrics"' in body
    assert get(server, "/healthz")[:3:2] == (200, b"ok\n")  # no health callable: nothing to be stuck on
    assert get(server, "/nope")[0] == 404


def test_start_fails_clearly_when_the_port_is_taken(node):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(CollectorRegistry(), listen_address="127.0.0.1", port=port)
        with pytest.raises(OSError) as exc:
            server.start()
        assert exc.value.strerror == f"cannot listen for metrics on 127.0.0.1:{port}: Address already in use"


# -- slow and stuck clients ---------------------------------------------------------------------
def test_stalled_client_does_not_block_others_and_is_cut_off(serve):
    server = serve(timeout_seconds=1.0)
    stalled = socket.create_connection(("127.0.0.1", server.port))
    trickler = socket.create_connection(("127.0.0.1", server.port))
    try:
        stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        trickler.sendall(b"GET /metrics HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert get(server, timeout=2.0)[0] == 200  # served while both hold connections
        stalled.settimeout(5.0)
        assert stalled.recv(100) == b""  # closed by the server
        # one header line every 0.3 s resets a per-read timeout forever; the deadline still cuts it
        closed = False
        for _ in range(40):
            try:
                trickler.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            if time.monotonic() - t0 > 8:
                break
            time.sleep(0.3)
        assert closed, "a trickling client kept its connection past the deadline"
    finally:
        stalled.close()
        trickler.close()
    server.refresh()
    text = get(server)[2].decode()
    assert metric_value(text, "sentinel_exporter_rejected_connections_total", reason="timeout") >= 1


def test_connections_over_the_limit_are_refused_not_queued(serve):
    server = serve(timeout_seconds=2.0, max_connections=2)
    holders = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    try:
        for h in holders:
            h.sendall(b"GET /metrics HTTP/1.0\r\n")
        wait_for(lambda: _refused(server), timeout=5, what="a third connection to be refused")
    finally:
        for h in holders:
            h.close()
    assert wait_for(lambda: _ok(server), timeout=5, what="scrapes to work once the holders left")
    server.refresh()
    text = get(server)[2].decode()
    assert metric_value(text, "sentinel_exporter_rejected_connections_total", reason="connection_limit") >= 1


def _refused(server: MetricsServer) -> bool:
    try:
        get(server, timeout=2.0)
    except (ConnectionError, http.client.RemoteDisconnected):
        return True
    return False


def _ok(server: MetricsServer) -> bool:
    try:
        return get(server, timeout=2.0)[0] == 200
    except (ConnectionError, http.client.RemoteDisconnected):
        return False


# -- TLS ----------------------------------------------------------------------------------------
def openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        pytest.skip("openssl not installed")
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    d = tmp_path / "pki"
    d.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=sentinel test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", *ext, cwd=d)
    return d


def client_context(pki: Path, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    return ctx


def test_tls_serves_https_only(serve, pki, node):
    server = serve(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"))
    node.view = view(43.0)
    server.refresh()
    status, _, body = get(server, context=client_context(pki))
    assert status == 200 and temperature(body) == 43.0
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        get(server, timeout=3.0)  # plain HTTP to the TLS port gets no metrics
    assert get(server, context=client_context(pki))[0] == 200  # a failed handshake harmed nothing


def test_mtls_requires_a_client_certificate_from_the_ca(serve, pki):
    server = serve(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"),
                   tls_client_ca_file=str(pki / "ca.crt"))
    assert get(server, context=client_context(pki, cert=True))[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        get(server, context=client_context(pki, cert=False), timeout=3.0)

    def tls_errors():
        server.refresh()
        text = get(server, context=client_context(pki, cert=True))[2].decode()
        return metric_value(text, "sentinel_exporter_rejected_connections_total", reason="tls_error")

    assert wait_for(tls_errors, timeout=5, what="the failed handshake to be counted") == 1


def test_tls_start_names_the_unusable_file(tmp_path):
    server = MetricsServer(CollectorRegistry(), listen_address="127.0.0.1", port=0,
                           tls_cert_file=str(tmp_path / "missing.crt"), tls_key_file=str(tmp_path / "missing.key"))
    with pytest.raises(OSError) as exc:
        server.start()
    assert "missing.crt" in exc.value.strerror


# -- basic auth ---------------------------------------------------------------------------------
def users_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "users"
    path.write_text(text)
    path.chmod(mode)
    return path


def basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_basic_auth_accepts_the_right_password_and_rejects_others(serve, tmp_path):
    path = users_file(tmp_path, "# scrapers\nprometheus:" + hash_password("s3cret pass", iterations=1000) + "\n")
    server = serve(basic_auth_users_file=str(path))
    status, _, body = get(server, headers=basic("prometheus", "s3cret pass"))
    assert status == 200 and b"sentinel_up 1.0" in body
    assert get(server, headers=basic("prometheus", "s3cret pass"))[0] == 200  # the cached path
    for headers in ({}, basic("prometheus", "wrong"), basic("nobody", "s3cret pass"),
                    {"Authorization": "Basic !!notbase64"}, {"Authorization": "Basic \u00e9t\u00e9"},
                    {"Authorization": "Bearer x"}):
        status, resp_headers, body = get(server, headers=headers)
        assert status == 401 and resp_headers["www-authenticate"].startswith('Basic realm="sentinel"'), headers
        assert b"sentinel_" not in body
    assert get(server, "/")[0] == 401  # every path is behind auth but the probes (kubelet sends no credentials),
    for probe in ("/livez", "/readyz", "/healthz"):  # which say ok or stuck and nothing else
        status, _, body = get(server, probe)
        assert status == 200 and b"sentinel_" not in body
    server.refresh()
    text = get(server, headers=basic("prometheus", "s3cret pass"))[2].decode()
    assert metric_value(text, "sentinel_exporter_rejected_connections_total", reason="unauthorized") == 7


def test_basic_auth_over_tls(serve, tmp_path, pki):
    path = users_file(tmp_path, "a:" + hash_password("pw", iterations=1000) + "\n")
    server = serve(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"),
                   basic_auth_users_file=str(path))
    assert get(server, headers=basic("a", "pw"), context=client_context(pki))[0] == 200
    assert get(server, headers=basic("a", "px"), context=client_context(pki))[0] == 401


def test_hash_password_command_makes_a_line_that_verifies(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sentinel.exporter", "hash-password", "alice", "--iterations", "2000"],
                       input="correct horse\n", capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("alice:pbkdf2_sha256$2000$")
    auth = BasicAuth(load_users(users_file(tmp_path, line + "\n")))
    assert auth.check("Basic " + base64.b64encode(b"alice:correct horse").decode()) == "alice"
    assert auth.check("Basic " + base64.b64encode(b"alice:correct horsE").decode()) is None


def test_django_pbkdf2_hashes_are_accepted():
    # Django's make_password("hunter2", salt="saltsaltsalt", hasher="pbkdf2_sha256") at 1000 iterations
    stored = hash_password("hunter2", iterations=1000, salt="saltsaltsalt")
    assert stored == "pbkdf2_sha256$1000$saltsaltsalt$" + base64.b64encode(
        __import__("hashlib").pbkdf2_hmac("sha256", b"hunter2", b"saltsaltsalt", 1000)).decode()
    assert BasicAuth({"u": stored}).check("Basic " + base64.b64encode(b"u:hunter2").decode()) == "u"


@pytest.mark.parametrize("text,mode,message", [
    ("alice\n", 0o600, ":1: expected user:hash"),
    ("alice:md5$abc\n", 0o600, ":1: the hash must look like"),
    ("alice:$2b$12$abcdefghijklmnopqrstuv\n", 0o600, "bcrypt hashes are not supported"),
    ("a:" + hash_password("x", iterations=1000, salt="saltx") + "\na:" + hash_password("y", iterations=1000, salt="salty") + "\n", 0o600,
     ":2: user 'a' is listed twice"),
    ("# nobody\n", 0o600, "no users"),
    ("a:" + hash_password("x", iterations=1000, salt="saltx") + "\n", 0o666, "writable by group or others"),
])
def test_bad_users_files_are_refused_naming_file_and_line(tmp_path, text, mode, message):
    path = users_file(tmp_path, text, mode)
    with pytest.raises(UsersFileError) as exc:
        load_users(path)
    assert str(path) in str(exc.value) and message in str(exc.value)


# -- config -------------------------------------------------------------------------------------
def test_metrics_config_validates_tls_and_auth_files(tmp_path, pki):
    good = users_file(tmp_path, "a:" + hash_password("x", iterations=1000) + "\n")
    cfg = config.parse(f'[metrics]\ntls_cert_file = "{pki}/server.crt"\ntls_key_file = "{pki}/server.key"\n'
                       f'tls_client_ca_file = "{pki}/ca.crt"\nbasic_auth_users_file = "{good}"\n')
    assert cfg.metrics.basic_auth_users_file == str(good) and cfg.metrics.listen_address == "0.0.0.0"
    for text, key in [
        (f'tls_cert_file = "{pki}/server.crt"\n', "metrics.tls_key_file"),
        (f'tls_client_ca_file = "{pki}/ca.crt"\n', "metrics.tls_client_ca_file"),
        (f'tls_cert_file = "{pki}/server.crt"\ntls_key_file = "{tmp_path}/nope.key"\n', "metrics.tls_key_file"),
        (f'tls_cert_file = "{pki}/server.crt"\ntls_key_file = "{pki}/client.key"\n', "metrics.tls_cert_file/tls_key_file"),
        (f'basic_auth_users_file = "{tmp_path}/nope"\n', "metrics.basic_auth_users_file"),
        (f'basic_auth_users_file = "{pki}/ca.crt"\n', "metrics.basic_auth_users_file"),
    ]:
        with pytest.raises(config.ConfigError) as exc:
            config.parse("[metrics]\n" + text)
        assert str(exc.value).startswith(key + ":"), (text, str(exc.value))


# -- a real Prometheus over TLS with basic auth --------------------------------------------------
@pytest.mark.needs_prometheus
def test_real_prometheus_scrapes_over_tls_with_basic_auth(serve, node, pki, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    path = users_file(tmp_path, "prom:" + hash_password("scrape-pw", iterations=1000) + "\n")
    server = serve(tls_cert_file=str(pki / "server.crt"), tls_key_file=str(pki / "server.key"),
                   basic_auth_users_file=str(path))
    node.view = view(66.0)
    server.refresh()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        prom_port = s.getsockname()[1]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: sentinel\n    scheme: https\n"
        f"    tls_config:\n      ca_file: {pki / 'ca.crt'}\n"
        "    basic_auth:\n      username: prom\n      password: scrape-pw\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def result():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            query = urllib.parse.urlencode({"query": 'sentinel_gpu_temperature_celsius{gpu="0"}'})
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/query?{query}", timeout=2) as r:
                    res = json.load(r)["data"]["result"]
            except OSError:
                return None
            return res or None

        res = wait_for(result, timeout=60, interval=0.5, what="Prometheus to scrape over TLS with basic auth")
        assert res[0]["value"][1] == "66"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
