"""A job's own certificate authority for its etcd rendezvous (``--rdzv-backend sentinel-etcd``).

    python -m sentinel.etcd_pki --dir /run/sentinel/jobs/JOB --job JOB --user alice \
        --member etcd0=10.0.0.1 --member etcd1=10.0.0.2,node1.example --member etcd2=10.0.0.3

One CA per job, made with ``openssl`` (present wherever etcd is): a server certificate per etcd
member (its IPs and names as subject alternative names; it also serves as the member's peer
certificate, checked against the same CA), and one client certificate for the job's agents.
Files are written mode 0600 (the CA certificate 0644: it is public) and handed to the job's user;
the CA's key is deleted once everything is signed, so nobody — root's later runs included — can
mint another certificate this job's etcd would accept. An operator who keeps a site CA instead
gives its files (docs/security.md: Slurm prolog, Kubernetes Secret).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pwd
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DAYS = "30"


@dataclass(frozen=True)
class JobPKI:
    """Paths of one job's certificates (``member_*`` per member name)."""

    dir: Path
    cacert: Path
    client_cert: Path
    client_key: Path

    def member_cert(self, name: str) -> Path:
        return self.dir / f"member-{name}.pem"

    def member_key(self, name: str) -> Path:
        return self.dir / f"member-{name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {args[0]}: {out.stderr.strip()[:300]}")


def _san(hosts: list[str]) -> str:
    parts = []
    for h in hosts:
        try:
            ipaddress.ip_address(h)
            parts.append(f"IP:{h}")
        except ValueError:
            parts.append(f"DNS:{h}")
    return ",".join(parts)


def _sign(d: Path, name: str, subject: str, ext: str) -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", DAYS, "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    (d / f"{name}.csr").unlink()
    (d / f"{name}.ext").unlink()


def _claim(directory: Path) -> int:
    """Make ``directory`` (0700) ours for the run, and return an fd on it. A directory that exists
    may be the job's user's (a requeued job: the prolog runs again): while it is theirs they could
    swap our work directory inside it for a symlink and have us chmod/chown what they planted
    there. So: no symlink, taken back (owner us, 0700) before anything is written, and a parent
    nobody else can rename it in (root's or ours; else not writable by others, or sticky)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    parent = os.stat(directory.parent)
    if parent.st_uid not in (0, os.geteuid()) or (parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX):
        raise RuntimeError(f"{directory.parent}: another user can rename entries in it; not used for a job's keys")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, os.geteuid(), os.getegid())
        os.fchmod(fd, 0o700)
        here, held = os.lstat(directory), os.fstat(fd)
        if (here.st_dev, here.st_ino) != (held.st_dev, held.st_ino):
            raise RuntimeError(f"{directory} was replaced while being taken over")
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_job_pki(directory: Path, job: str, members: dict[str, list[str]], *, uid: int | None = None,
                 gid: int | None = None) -> JobPKI:
    """Create the job's CA, one certificate per member (``members``: name -> its IPs/hostnames)
    and the client certificate, in ``directory`` (created 0700; an existing one is taken back
    first, :func:`_claim`). Keys 0600; with ``uid``/``gid`` every file and the directory are handed
    to the job's user once all is written. The CA key is removed at the end."""
    dfd = _claim(directory)
    old = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            d = Path(tmp)
            _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                     "-keyout", "ca.key", "-out", "ca.pem", "-days", DAYS, "-subj", f"/CN=sentinel job {job} CA",
                     "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                     cwd=d)
            for name, hosts in members.items():
                _sign(d, f"member-{name}", f"/CN=etcd {name}",
                      "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                      "extendedKeyUsage=serverAuth,clientAuth\n"
                      f"subjectAltName={_san(hosts + ['127.0.0.1', 'localhost'])}\n")
            _sign(d, "client", f"/CN=sentinel-job-{job}",
                  "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n")
            (d / "ca.key").unlink()  # nobody can mint another certificate for this job
            for f in d.iterdir():
                if not stat.S_ISREG(f.lstat().st_mode):
                    raise RuntimeError(f"{f}: not a regular file (something else wrote in {d})")
                if f.suffix in (".pem", ".key"):
                    os.chmod(f, 0o644 if f.name == "ca.pem" else 0o600)
                    if uid is not None:
                        os.chown(f, uid, gid if gid is not None else -1)
                    os.replace(f, directory / f.name)
                else:
                    f.unlink()
        if uid is not None:
            os.fchown(dfd, uid, gid if gid is not None else -1)
    finally:
        os.umask(old)
        os.close(dfd)
    return JobPKI(directory, directory / "ca.pem", directory / "client.pem", directory / "client.key")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sentinel.etcd_pki", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the files go (created 0700; an existing one is taken back for the run; "
                    "its parent root's, not writable by others unless sticky)")
    ap.add_argument("--job", required=True, help="the job's name (in the certificates' subjects)")
    ap.add_argument("--user", default="", help="hand every file to this user (the job's)")
    ap.add_argument("--member", action="append", default=[], metavar="NAME=ADDR[,ADDR]",
                    help="an etcd member and the addresses/names its certificate is valid for (repeat)")
    args = ap.parse_args(argv)
    members: dict[str, list[str]] = {}
    for m in args.member:
        name, sep, addrs = m.partition("=")
        if not sep or not name or not addrs:
            ap.error(f"--member {m!r}: NAME=ADDR[,ADDR]")
        members[name] = [a for a in addrs.split(",") if a]
    uid = gid = None
    if args.user:
        try:
            pw = pwd.getpwnam(args.user)
        except KeyError:
            ap.error(f"--user {args.user}: no such user")
        uid, gid = pw.pw_uid, pw.pw_gid
    pki = make_job_pki(args.dir, args.job, members, uid=uid, gid=gid)
    print(f"--rdzv-conf cacert={pki.cacert},cert={pki.client_cert},key={pki.client_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
