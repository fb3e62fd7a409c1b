"""Basic auth and TLS for the metrics listener: the users file, its password hashes, the server's
TLS context. No HTTP and no Prometheus here, so ``sentinel.config`` can check the files a
configuration names (``metrics.tls_*``, ``metrics.basic_auth_users_file``) without importing the
server (:mod:`sentinel.exporter`).

A users file holds ``user:hash`` lines where hash is
``pbkdf2_sha256$<iterations>$<salt>$<base64 sha256 digest>`` (Django's format). Make a line with::

    python -m sentinel.exporter hash-password USER        # reads the password from stdin
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import ssl
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

PBKDF2_SCHEME = "pbkdf2_sha256"
# OWASP's 2023 figure for PBKDF2-HMAC-SHA256. A verified password is cached (see BasicAuth), so
# this is paid once per credential, not per scrape.
DEFAULT_ITERATIONS = 600_000
MIN_ITERATIONS = 1_000


# -- basic auth ---------------------------------------------------------------------------------
class UsersFileError(ValueError):
    """The basic-auth users file cannot be used; the message names the file (and line)."""


def hash_password(password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: str | None = None) -> str:
    """A ``pbkdf2_sha256$iterations$salt$hash`` string for a users file line."""
    if iterations < MIN_ITERATIONS:
        raise ValueError(f"iterations must be >= {MIN_ITERATIONS}")
    salt = salt or secrets.token_urlsafe(16)
    if "$" in salt:
        raise ValueError("salt must not contain '$'")
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations)
    return f"{PBKDF2_SCHEME}${iterations}${salt}${base64.b64encode(digest).decode('ascii')}"


@dataclass(frozen=True)
class _Pbkdf2:
    iterations: int
    salt: bytes
    digest: bytes

    def matches(self, password: bytes) -> bool:
        candidate = hashlib.pbkdf2_hmac("sha256", password, self.salt, self.iterations, len(self.digest))
        return hmac.compare_digest(candidate, self.digest)


def _parse_hash(text: str, where: str) -> _Pbkdf2:
    if text.startswith(("$2a$", "$2b$", "$2y$")):
        raise UsersFileError(f"{where}: bcrypt hashes are not supported; make a line with "
                             "`python -m sentinel.exporter hash-password USER`")
    parts = text.split("$")
    if len(parts) != 4 or parts[0] != PBKDF2_SCHEME:
        raise UsersFileError(f"{where}: the hash must look like {PBKDF2_SCHEME}$<iterations>$<salt>$<base64 digest>")
    _, iterations, salt, digest = parts
    if not iterations.isdigit() or int(iterations) < MIN_ITERATIONS:
        raise UsersFileError(f"{where}: iterations must be a number >= {MIN_ITERATIONS} (got {iterations!r})")
    try:
        raw = base64.b64decode(digest, validate=True)
    except binascii.Error:
        raise UsersFileError(f"{where}: the digest is not valid base64") from None
    if len(raw) < 16 or not salt:
        raise UsersFileError(f"{where}: the salt is empty or the digest is shorter than 16 bytes")
    return _Pbkdf2(int(iterations), salt.encode(), raw)


def load_users(path: str | Path) -> dict[str, str]:
    """``user -> hash`` from a users file; blank lines and ``#`` comments are skipped.

    Raises UsersFileError naming the file and line: unreadable, group/other-writable (anyone who
    can write it can let themselves in), a line without ``user:hash``, a duplicate user, or a hash
    in an unknown format.
    """
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsersFileError(f"{path}: cannot read users file: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsersFileError(f"{path}: not a regular file")
    if st.st_mode & 0o022:
        raise UsersFileError(f"{path}: is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); chmod go-w")
    users: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        user, sep, hashed = line.partition(":")
        if not sep or not user or not hashed:
            raise UsersFileError(f"{where}: expected user:hash")
        if user in users:
            raise UsersFileError(f"{where}: user {user!r} is listed twice")
        _parse_hash(hashed, where)
        users[user] = hashed
    if not users:
        raise UsersFileError(f"{path}: no users (every scrape would be refused)")
    return users


class BasicAuth:
    """Checks ``Authorization: Basic`` headers against ``user -> hash``.

    Digests are compared with :func:`hmac.compare_digest`; an unknown user is checked against a
    dummy hash of the same cost, so timing does not tell which users exist. A verified
    (user, password) pair is remembered by its SHA-256, as Prometheus' exporter-toolkit does, so a
    scrape does not pay PBKDF2's cost; unverified attempts run one at a time, so a flood of wrong
    passwords costs at most one core.
    """

    _CACHE_MAX = 1024

    def __init__(self, users: Mapping[str, str]) -> None:
        self._users = {u: _parse_hash(h, f"user {u!r}") for u, h in users.items()}
        iterations = max((h.iterations for h in self._users.values()), default=DEFAULT_ITERATIONS)
        self._dummy = _Pbkdf2(iterations, secrets.token_bytes(16), secrets.token_bytes(32))
        self._verified: set[bytes] = set()
        self._slow = threading.Lock()

    def check(self, header: str | None) -> str | None:
        """The authenticated user name, or None."""
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user_b, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
            user = user_b.decode("utf-8")
        except ValueError:  # not base64 (binascii.Error), not ASCII, or not UTF-8 (UnicodeDecodeError)
            return None
        if not sep:
            return None
        stored = self._users.get(user)
        key = hashlib.sha256(b"\0".join([user_b, password, stored.digest if stored else b""])).digest()
        if stored is not None and key in self._verified:
            return user
        with self._slow:
            ok = (stored or self._dummy).matches(password) and stored is not None
        if not ok:
            return None
        if len(self._verified) >= self._CACHE_MAX:
            self._verified.clear()
        self._verified.add(key)
        return user


# -- TLS ----------------------------------------------------------------------------------------
def build_tls_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A server context (TLS 1.2+); with ``client_ca_file`` clients must present a certificate
    that CA signed. Raises OSError (a missing file) or ssl.SSLError (a bad or mismatched one)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
