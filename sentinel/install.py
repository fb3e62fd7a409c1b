"""``sentinel install``: put a GPU node's files in place after ``pip install sentinel-gpu``.

* ``/etc/systemd/system/sentinel.service`` and ``sentinel-agent@.service``: the units shipped in
  the package (``sentinel/units``), with ``ExecStart=`` pointing at this installation's
  ``sentinel`` command. They belong to the package: an upgrade replaces them.
* ``/etc/sentinel/sentinel.toml``: the default configuration, written only when there is none.
  A configuration that differs from the shipped default belongs to the operator and is never
  overwritten: the new default is written next to it as ``sentinel.toml.new``, and the existing
  file is validated against this version (an upgrade that would make the daemon refuse to start
  says so now, exit 1, naming the key).
* ``/etc/sentinel`` (0755) and ``/var/lib/sentinel`` (0750, the cordon marker and the migration
  record), root-owned and writable by nobody else. ``/run/sentinel`` is the unit's
  ``RuntimeDirectory=``.

The ``sentinel`` command the units run as root, the interpreter on its ``#!`` line (``#!/usr/bin/env
python3`` resolved on PATH, pip's ``/bin/sh`` + ``'''exec'`` form for long paths read through), and
the package it runs, must be root's alone (file and every directory above): an install from a
user's virtualenv or checkout, or a root-owned script whose interpreter another user can change,
is refused, naming the path. The agent unit runs the launcher as ``<that python> -I -m sentinel
launch`` (isolated: the env file's PYTHONPATH reaches only the job).
The unit must also be able to start: an installation that lies under
a path the unit's own sandbox hides (``ProtectHome=`` hides /root and /home, ``PrivateTmp=``
/tmp and /var/tmp, ``InaccessiblePaths=``, ``TemporaryFileSystem=``; drop-ins in
``<unit>.d/*.conf`` count, and ``BindPaths=``/``BindReadOnlyPaths=`` show a path again) is
refused, naming the path, the setting that hides it and the fix (:func:`check_unit_can_start`).

Idempotent: a second run changes nothing and says so. ``--root DIR`` installs into an image or a
staging tree (paths inside the files stay absolute). Every file is replaced atomically
(:func:`sentinel.fsutil.write_atomic`), never written through a symlink.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sentinel import config as config_mod
from sentinel.fsutil import UnsafePath, check_private_dir, ensure_private_dir, write_atomic

UNITS = ("sentinel.service", "sentinel-agent@.service")
CONFIG = "sentinel.toml"
SHIPPED_BIN = "/usr/local/bin/sentinel"
SHIPPED_PYTHON = "/usr/bin/python3 -I -m sentinel"  # the agent unit's launcher


class InstallError(RuntimeError):
    """Installation cannot go on; the message is one sentence naming the path and the fix."""


def shipped(name: str) -> str:
    return (importlib.resources.files("sentinel") / "units" / name).read_text()


def default_bin() -> str:
    """This installation's ``sentinel`` command: the running console script, else the one on PATH."""
    if os.path.basename(sys.argv[0]) == "sentinel" and os.path.isfile(sys.argv[0]):
        return os.path.abspath(sys.argv[0])
    found = shutil.which("sentinel")
    if found:
        return os.path.abspath(found)
    raise InstallError("cannot tell where the sentinel command is installed; pass --bin /path/to/sentinel")


def unit_text(name: str, sentinel_bin: str, python: str | None = None) -> str:
    text = shipped(name).replace(SHIPPED_BIN, sentinel_bin)
    return text.replace(SHIPPED_PYTHON, f"{python} -I -m sentinel") if python else text


def interpreters(path: str) -> list[str]:
    """Every program that runs before ``path``'s own code when it is executed: the ``#!``
    interpreter, then what ``#!/usr/bin/env NAME`` finds on PATH or what pip's long-path form
    (``#!/bin/sh``, then ``'''exec' "PY" "$0" "$@"``) hands over to. Empty for a binary or a
    script without ``#!``. Raises InstallError for a ``#!`` line that names no absolute program."""
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError as exc:
        raise InstallError(f"cannot read {path}: {exc.strerror}") from None
    if not head.startswith(b"#!"):
        return []
    lines = head[2:].split(b"\n")
    words = lines[0].decode("utf-8", "replace").split()
    if not words or not os.path.isabs(words[0]):
        raise InstallError(f"{path}: its #! line names no absolute interpreter ({lines[0][:80]!r})")
    chain = [words[0]]
    if os.path.basename(words[0]) == "env":
        names = [w for w in words[1:] if not w.startswith("-")]
        found = shutil.which(names[0]) if names else None
        if not found:
            raise InstallError(f"{path}: #!{' '.join(words)} names no program found on PATH")
        chain.append(os.path.abspath(found))
    elif os.path.basename(words[0]) in ("sh", "bash", "dash") and len(lines) > 1 and lines[1].startswith(b"'''exec' "):
        quoted = lines[1].decode("utf-8", "replace").split('"')
        if len(quoted) < 2 or not os.path.isabs(quoted[1]):
            raise InstallError(f"{path}: cannot read the interpreter of its '''exec' line")
        chain.append(quoted[1])
    return chain


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _replace(path: Path, text: str, mode: int) -> str:
    """Write ``text`` to ``path`` unless it already holds exactly that: "unchanged", "installed" or "updated"."""
    try:
        current = path.read_text() if not path.is_symlink() else None
    except FileNotFoundError:
        current = None
    if current == text:
        return "unchanged"
    existed = os.path.lexists(path)
    write_atomic(path, text, mode=mode)
    return "updated" if existed else "installed"


def check_root_owned(path: str, what: str) -> None:
    """Refuse to point root's units at code another user could change: ``path`` (symlinks
    resolved) and every directory above it must be root's and writable by nobody else (an
    install from a user's virtualenv or checkout would hand that user root)."""
    real = os.path.realpath(path)
    owners = frozenset({0, os.geteuid()})
    try:
        st = os.stat(real)
        if st.st_uid not in owners or st.st_mode & 0o022:
            raise UnsafePath(f"{real} is owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}, "
                             f"not root's alone")
        check_private_dir(real if os.path.isdir(real) else os.path.dirname(real), "directory", owners=owners)
    except UnsafePath as exc:
        raise InstallError(f"refusing to install: {what} would run as root, but {exc}; install sentinel where only "
                           f"root can write (pip install as root, outside any user's directory)") from None
    except OSError as exc:
        raise InstallError(f"cannot check {real}: {exc.strerror}") from None


_YES = ("1", "yes", "true", "on")


def hidden_paths(unit: str, dropins: list[str] = ()) -> tuple[dict[str, str], list[str]]:
    """What a unit's sandbox hides from its own processes: ({hidden path: the setting that hides
    it}, [paths bound back in]). ``unit`` and then each drop-in, in order, as systemd reads them
    (a later assignment of a setting wins; an empty one resets a list)."""
    settings: dict[str, str] = {}
    lists: dict[str, list[str]] = {"InaccessiblePaths": [], "TemporaryFileSystem": [], "BindPaths": [],
                                   "BindReadOnlyPaths": []}
    for text in (unit, *dropins):
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]" or "=" not in line:
                continue
            key, value = (x.strip() for x in line.split("=", 1))
            if key in lists:
                if value:
                    lists[key].extend(value.split())
                else:
                    lists[key] = []
            else:
                settings[key] = value
    hidden: dict[str, str] = {}
    home = settings.get("ProtectHome", "no").lower()
    if home in _YES or home == "tmpfs":
        for path in ("/home", "/root", "/run/user"):
            hidden[path] = f"ProtectHome={settings['ProtectHome']}"
    if settings.get("PrivateTmp", "no").lower() in _YES:
        for path in ("/tmp", "/var/tmp"):
            hidden[path] = f"PrivateTmp={settings['PrivateTmp']}"
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        for entry in lists[key]:
            path = entry.lstrip("-+").split(":", 1)[0]
            if path.startswith("/"):
                hidden[path] = f"{key}={path}"
    bound = []
    for key in ("BindPaths", "BindReadOnlyPaths"):
        for entry in lists[key]:
            parts = entry.lstrip("-").split(":")
            dest = parts[1] if len(parts) > 1 and parts[1].startswith("/") else parts[0]
            bound.append(dest)
    return hidden, bound


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def needed_paths(sentinel_bin: str) -> tuple[list[tuple[str, str]], str]:
    """(path, what) the unit's ExecStart= needs to see: the command, its interpreter (from the
    ``#!`` line), and for Python that interpreter's prefixes and the ``sentinel`` package it
    imports (asked of the interpreter itself, isolated from this process's environment); and
    the interpreter that cannot import sentinel at all ("" when it can, or is not Python)."""
    need = [(sentinel_bin, "the sentinel command (ExecStart=)"),
            (os.path.realpath(sentinel_bin), "the sentinel command (ExecStart=)")]
    try:
        with open(sentinel_bin, "rb") as f:
            first = f.readline(512)
    except OSError:
        return need, ""
    if not first.startswith(b"#!"):
        return need, ""
    words = first[2:].decode("utf-8", "replace").split()
    if not words:
        return need, ""
    interp = words[0]
    if os.path.basename(interp) == "env" and len(words) > 1:
        interp = shutil.which(words[1]) or words[1]
    need += [(interp, "its interpreter (#! line)"), (os.path.realpath(interp), "its interpreter (#! line)")]
    if "python" not in os.path.basename(interp):
        return need, ""
    code = ("import importlib.util, json, sys; s = importlib.util.find_spec('sentinel'); "
            "print(json.dumps([sys.prefix, sys.base_prefix, s.origin if s else None]))")
    try:
        r = subprocess.run([interp, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
        prefix, base, origin = json.loads(r.stdout)
    except (OSError, ValueError, TypeError, subprocess.TimeoutExpired):
        return need, ""
    need += [(prefix, "its Python installation"), (base, "its Python installation")]
    if origin is None:
        return need, interp
    package = os.path.dirname(origin)
    need += [(package, "the sentinel package it imports"), (os.path.realpath(package), "the sentinel package it imports")]
    return need, ""


def check_unit_can_start(name: str, unit: str, dropins: list[str], need: list[tuple[str, str]]) -> None:
    """Refuse (InstallError naming the path, the setting and the fix) when the unit's sandbox
    hides a path its ExecStart= needs: systemd would fail it at every start (status 203/EXEC or
    a Python that finds no module), a daemon never watching the node."""
    hidden, bound = hidden_paths(unit, dropins)
    for path, what in need:
        path = os.path.normpath(path)
        for top, setting in sorted(hidden.items()):
            if _inside(path, top) and not any(_inside(path, b) for b in bound):
                raise InstallError(
                    f"refusing to install: {name} could not start: {what} {path} lies under {top}, which the "
                    f"unit hides ({setting}); install sentinel where the unit sees it, e.g. "
                    f"`python3 -m venv /opt/sentinel && /opt/sentinel/bin/pip install sentinel-gpu && "
                    f"/opt/sentinel/bin/sentinel install`, or bind it in with a drop-in "
                    f"/etc/systemd/system/{name}.d/*.conf holding [Service] BindReadOnlyPaths={path}")


def _dropins(root: Path, name: str) -> list[str]:
    d = _under(root, f"/etc/systemd/system/{name}.d")
    try:
        return [p.read_text() for p in sorted(d.glob("*.conf")) if p.is_file()]
    except OSError:
        return []


def install(root: Path, sentinel_bin: str, *, reload_systemd: bool, out=print) -> int:
    """Install into ``root``; returns the exit status (0, or 1 when the kept config is invalid)."""
    if not os.path.isabs(sentinel_bin):
        raise InstallError(f"--bin {sentinel_bin} must be an absolute path (systemd runs ExecStart= as given)")
    if not os.access(sentinel_bin, os.X_OK):
        raise InstallError(f"{sentinel_bin} is not an executable file; pass --bin /path/to/sentinel")
    check_root_owned(sentinel_bin, "the sentinel command (ExecStart=)")
    chain = interpreters(sentinel_bin)
    for program in chain:
        check_root_owned(program, f"the interpreter of {sentinel_bin} (its #! line)")
    python = chain[-1] if chain and os.path.basename(chain[-1]).startswith("python") else sys.executable
    check_root_owned(python, "the Python of the agent unit's launcher")
    check_root_owned(str(Path(config_mod.__file__).parent), "the sentinel package")
    need, no_package = needed_paths(sentinel_bin)
    for name in UNITS:
        check_unit_can_start(name, unit_text(name, sentinel_bin), _dropins(root, name), need)
    if no_package:
        raise InstallError(f"refusing to install: {no_package} (the #! line of {sentinel_bin}) cannot import the "
                           f"sentinel package, so the units could not start; pass --bin with the sentinel command of "
                           f"the installation that has it")
    try:
        for path, mode in ((_under(root, "/etc/sentinel"), 0o755), (_under(root, "/var/lib/sentinel"), 0o750),
                           (_under(root, "/etc/systemd/system"), 0o755)):
            ensure_private_dir(path, "directory", mode=mode)
    except UnsafePath as exc:
        raise InstallError(f"refusing to install: {exc}") from None
    except OSError as exc:
        raise InstallError(f"cannot create {exc.filename}: {exc.strerror}") from None
    changed = False
    status = 0
    try:
        for name in UNITS:
            unit = _under(root, f"/etc/systemd/system/{name}")
            outcome = _replace(unit, unit_text(name, sentinel_bin, python), 0o644)
            changed |= outcome != "unchanged"
            out(f"{unit}: {outcome}")
        conf = _under(root, f"/etc/sentinel/{CONFIG}")
        default = shipped(CONFIG)
        if not os.path.lexists(conf):
            write_atomic(conf, default, mode=0o644)
            out(f"{conf}: installed (the defaults; edit it, then `systemctl reload sentinel`)")
        elif not conf.is_symlink() and conf.read_text() == default:
            out(f"{conf}: unchanged")
        else:
            new = conf.with_name(CONFIG + ".new")
            _replace(new, default, 0o644)
            out(f"{conf}: kept, it differs from the shipped default (never overwritten); "
                f"this version's default is in {new}")
            try:
                config_mod.load(conf)
            except config_mod.ConfigError as exc:
                out(f"{conf}: the daemon of this version would refuse it: {exc}")
                status = 1
    except OSError as exc:
        raise InstallError(f"cannot write {exc.filename}: {exc.strerror}") from None
    if reload_systemd and changed and root == Path("/") and os.path.isdir("/run/systemd/system"):
        r = subprocess.run(["systemctl", "daemon-reload"], capture_output=True, text=True, timeout=60)
        out("systemctl daemon-reload: " + ("ok" if r.returncode == 0 else f"failed: {r.stderr.strip()}"))
    out("next: systemctl enable --now sentinel.service")
    return status
