"""The kernel-log signature catalog (``sentinel/signatures.toml``) and the one classifier that
every kernel path uses: the eBPF ``printk:console`` probe, the /dev/kmsg fallback and
``sentinel scan``.

A message is classified only by what it STARTS with (the catalog's patterns are anchored): a
kernel message that quotes user text somewhere in it is no driver report. :func:`Catalog.classify`
takes a bare message text (what printk:console and /dev/kmsg deliver once the record header is
off); :func:`Catalog.classify_line` takes a log line and strips exactly the documented log prefixes
first (dmesg, ``dmesg -T``, syslog, journal, ``<N>``, a /dev/kmsg record header; see
:mod:`sentinel.sources.xidparse`). Neither raises: anything that is not a known signature is None.

The catalog is data. :func:`load` validates it (unknown keys, bad values and patterns are errors
naming the entry and key) and :func:`default_catalog` loads the one shipped with the package once.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Mapping

from sentinel.pci import normalize_bus_id

BUS = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?"
SEVERITIES = ("info", "warning", "critical")
ACTIONS = ("alert", "snapshot", "migrate")
MAX_MESSAGE = 4096  # a kernel record is at most 1 KiB of text; longer input is cut, never scanned whole
MAX_PREFIX = 32  # what the eBPF filter compares (HEAD_LEN in ebpf/xid.bpf.c)
_KEYS = {"name", "kind", "severity", "action", "prefix", "pattern", "source"}
_OPTIONAL_KEYS = {"needle", "joins"}
ANY = "*"  # a prefix that stands for any text: the pattern alone decides (never passed by the eBPF filter)
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


class CatalogError(ValueError):
    """The catalog file is unreadable or one of its entries is wrong (the message names it)."""


@dataclass(frozen=True)
class Signature:
    name: str
    kind: str
    severity: str  # info | warning | critical | xid (decided by the Xid's action)
    action: str  # alert | snapshot | migrate | xid
    prefixes: tuple[str, ...]  # literal starts (the eBPF filter's); ANY is kept apart in ``needle``
    regex: re.Pattern[str]
    source: str
    needle: str | None = None  # with prefix ANY: a literal the message must contain before the pattern is tried
    joins: tuple[str, ...] = ()  # a record split over several: the starts of the records that continue it

    def match(self, text: str) -> re.Match[str] | None:
        if not text.startswith(self.prefixes) and (self.needle is None or self.needle not in text):
            return None
        return self.regex.match(text)


@dataclass(frozen=True)
class Match:
    """One message the catalog recognises."""

    signature: str
    kind: str
    severity: str
    action: str
    pci_bus_id: str | None  # normalised 0000:3b:00.0: the device the message is about, if it names one
    source_bus_id: str | None = None  # AER: the device that sent the error (the bus id is the port's)
    xid: int | None = None
    count: int | None = None
    message: str = ""


@dataclass(frozen=True)
class Catalog:
    signatures: tuple[Signature, ...]
    xid_meanings: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # one C call rejects the messages no signature can match (nearly all of a log)
        object.__setattr__(self, "_starts", tuple({p for s in self.signatures for p in s.prefixes}))
        object.__setattr__(self, "_joins", tuple((s, s.prefixes, s.joins) for s in self.signatures if s.joins))
        needles = sorted({s.needle for s in self.signatures if s.needle})
        object.__setattr__(self, "_needle", re.compile("|".join(map(re.escape, needles))) if needles else None)
        # every pattern in one alternation, in catalog order: the first alternative that matches is the
        # first entry whose pattern does (its own groups made non-capturing: one C call per message)
        alternatives = "|".join(f"(?P<_{i}>{_uncaptured(s.regex.pattern)})" for i, s in enumerate(self.signatures))
        object.__setattr__(self, "_any", re.compile(alternatives))

    def prefixes(self, *, without_xid: bool = False) -> tuple[str, ...]:
        """The distinct prefixes, longest first dropped when a shorter one covers it (the eBPF
        filter passes a message that starts with any of them)."""
        every = sorted({p for s in self.signatures if not (without_xid and s.kind == "xid") for p in s.prefixes},
                       key=len)
        kept: list[str] = []
        for p in every:
            if not any(p.startswith(k) for k in kept):
                kept.append(p)
        return tuple(kept)

    def classify(self, text: object) -> Match | None:
        """The signature a bare kernel message text starts with, or None. Never raises."""
        if not isinstance(text, str):
            return None
        text = text[:MAX_MESSAGE]
        if "\\x0a" in text:
            text = text.replace("\\x0a", "\n")  # /dev/kmsg escapes a record's newlines
        text = text.strip()
        if not text.startswith(self._starts) and (self._needle is None or self._needle.search(text) is None):
            return None
        first = self._any.match(text)
        if first is None:
            return None
        return self._classify(text, int(next(k for k, v in first.groupdict().items() if v is not None)[1:]))

    def entry(self, name: str) -> Signature | None:
        """The catalog entry of that name (``sentinel scan --explain``)."""
        return next((s for s in self.signatures if s.name == name), None)

    def starts_like_entry(self, text: str) -> list[str]:
        """The entries whose prefix (or needle) ``text`` has, though it may match none of them."""
        text = text.replace("\\x0a", "\n").strip()
        return [s.name for s in self.signatures
                if text.startswith(s.prefixes) or (s.needle is not None and s.needle in text)]

    def continues(self, head: str, text: str) -> bool:
        """True when ``text`` (a record's message) continues ``head``, the message of a record
        split over several that no signature matches yet (the fallen-off-bus message a driver
        prints in parts): the head starts like an entry with ``joins`` and ``text`` starts with
        one of them."""
        for sig, starts, joins in self._joins:
            if head.startswith(starts) and text.startswith(joins) and sig.match(head) is None:
                return True
        return False

    def opens_split(self, head: str) -> bool:
        """True when ``head`` starts a message printed in parts (an entry with ``joins``) that
        it does not complete on its own."""
        return any(head.startswith(starts) and sig.match(head) is None for sig, starts, _ in self._joins)

    def _classify(self, text: str, start: int = 0) -> Match | None:
        for sig in self.signatures[start:]:
            m = sig.match(text)
            if m is None:
                continue
            groups = m.groupdict()
            bus = _bus(groups.get("bus") or groups.get("switch"))
            xid = int(groups["xid"]) if groups.get("xid") else None
            count = int(groups["count"]) if groups.get("count") else None
            return Match(sig.name, sig.kind, sig.severity, sig.action, bus, _bus(groups.get("source_bus")), xid, count,
                         " ".join(text.split())[:512])
        return None

    def classify_line(self, line: object) -> Match | None:
        """The signature of one log line (a documented prefix, then the message), or None."""
        from sentinel.sources.xidparse import strip_prefix

        if not isinstance(line, str):
            return None
        return self.classify(strip_prefix(line[:MAX_MESSAGE]))


_GROUP = re.compile(r"\(\?P<[A-Za-z_]\w*>")


def _uncaptured(pattern: str) -> str:
    """``pattern`` with its named groups made non-capturing (for the one alternation)."""
    return _GROUP.sub("(?:", pattern)


def _bus(text: str | None) -> str | None:
    return normalize_bus_id(text) if text else None


def parse(text: str, where: str = "signatures.toml") -> Catalog:
    """Build a catalog from TOML text; raises CatalogError naming the entry and key at fault."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{where}: not valid TOML: {exc}") from None
    unknown = set(data) - {"signature", "xid"}
    if unknown:
        raise CatalogError(f"{where}: unknown table {sorted(unknown)[0]!r} (expected [[signature]] and [xid])")
    entries = data.get("signature", [])
    if not isinstance(entries, list) or not entries:
        raise CatalogError(f"{where}: no [[signature]] entries")
    sigs: list[Signature] = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        sigs.append(_signature(entry, f"{where}: signature[{i}]"))
        if sigs[-1].name in names:
            raise CatalogError(f"{where}: signature[{i}]: name {sigs[-1].name!r} is used twice")
        names.add(sigs[-1].name)
    meanings: dict[int, str] = {}
    for key, value in data.get("xid", {}).items():
        if not key.isdigit() or not isinstance(value, str) or not value:
            raise CatalogError(f"{where}: xid.{key}: expected an Xid number = \"its meaning\"")
        meanings[int(key)] = value
    return Catalog(tuple(sigs), meanings)


def _signature(entry: object, where: str) -> Signature:
    if not isinstance(entry, dict):
        raise CatalogError(f"{where}: not a table")
    for key in entry:
        if key not in _KEYS and key not in _OPTIONAL_KEYS:
            raise CatalogError(f"{where}: unknown key {key!r}")
    for key in _KEYS:
        if key not in entry:
            raise CatalogError(f"{where}: missing key {key!r}")
    name = entry["name"]
    where = f"{where} ({name})"
    if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(entry["kind"], str) \
            or not _NAME.fullmatch(entry["kind"]):
        raise CatalogError(f"{where}: name and kind must be lower_case identifiers")
    if entry["severity"] not in (*SEVERITIES, "xid") or entry["action"] not in (*ACTIONS, "xid"):
        raise CatalogError(f"{where}: severity must be one of {', '.join(SEVERITIES)} and action one of "
                           f"{', '.join(ACTIONS)} (or both xid)")
    if (entry["severity"] == "xid") != (entry["action"] == "xid"):
        raise CatalogError(f"{where}: severity and action are xid together or not at all")
    prefixes = entry["prefix"] if isinstance(entry["prefix"], list) else [entry["prefix"]]
    if not prefixes or any(not _literal(p) for p in prefixes):
        raise CatalogError(f"{where}: prefix must be 1 to {MAX_PREFIX} printable characters (no quote or backslash)")
    needle = entry.get("needle")
    if (ANY in prefixes) != (needle is not None) or (needle is not None and not _literal(needle)):
        raise CatalogError(f"{where}: prefix {ANY!r} and needle (a literal the message contains) go together")
    joins = entry.get("joins", [])
    if not isinstance(joins, list) or any(not _literal(j) for j in joins):
        raise CatalogError(f"{where}: joins must be a list of literal record starts")
    if not isinstance(entry["pattern"], str) or not isinstance(entry["source"], str) or not entry["source"]:
        raise CatalogError(f"{where}: pattern and source must be strings")
    try:
        regex = re.compile(entry["pattern"].replace("{BUS}", BUS))
    except re.error as exc:
        raise CatalogError(f"{where}: pattern does not compile: {exc}") from None
    return Signature(name, entry["kind"], entry["severity"], entry["action"], tuple(p for p in prefixes if p != ANY),
                     regex, entry["source"], needle, tuple(joins))


def _literal(p: object) -> bool:
    return isinstance(p, str) and 0 < len(p) <= MAX_PREFIX and p.isprintable() and '"' not in p and "\\" not in p


def load(path: str | Path | None = None) -> Catalog:
    """The catalog at ``path``, or the one shipped with the package."""
    if path is None:
        text = resources.files("sentinel").joinpath("signatures.toml").read_text(encoding="utf-8")
        return parse(text, "sentinel/signatures.toml")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read: {exc.strerror}") from None
    return parse(text, str(path))


@functools.lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The shipped catalog, parsed once (immutable)."""
    return load()


def xid_severity(action: str | None, application: bool) -> str:
    """What ``sentinel scan`` calls an Xid: critical when the policy migrates on it, warning when
    it snapshots or merely alerts, info for an application Xid or one the operator skips."""
    if action == "migrate":
        return "critical"
    if action == "ignore" or (application and action is None):
        return "info"
    return "warning"
