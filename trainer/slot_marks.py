"""Reading the slot rendezvous's own records back from the store, one parser for all of them.

The slot rendezvous (``trainer.slot_rendezvous``) writes four kinds of values: the generation
number under ``latest``, a generation's committed record under ``g<f>`` (JSON object), a slot's
arrival mark under ``g<f>/s<slot>`` (a JSON object with the node's ``id``, or ``LEFT:<id>`` once
its node left or was declared gone) and a vacancy under ``vacancy/<n>`` (JSON object: slot, gen,
left). On a TCPStore anyone who reaches the port can write any of them (docs/security.md), and a
half-written or foreign value must not crash a node's agent with a bare ``ValueError``/``KeyError``
from deep inside the rendezvous:

- an arrival mark that is not one of ours (not JSON, not an object, no string ``id``) belongs to
  nobody: it is never "mine" (the node reads its slot as taken and waits as a spare or is fenced,
  the direction that never lets two nodes step as one rank);
- a malformed vacancy is skipped (counted, logged with its key): the spare takes a new ticket;
- a malformed ``latest`` or generation record leaves the rendezvous no way forward: it raises
  :class:`MalformedRecord` naming the key and the value (shown, bounded), the line torchrun's
  agent ends with; a watcher's pass skips its turn instead (:func:`next_generation`).

Every malformed value read is counted in :data:`MALFORMED` (per kind) and logged once per key.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Any

from sentinel.settings import printable

log = logging.getLogger(__name__)

LEFT = "LEFT:"
MALFORMED: Counter[str] = Counter()  # kind -> malformed values read (this process)
_logged: set[str] = set()
_lock = threading.Lock()
SHOWN_MAX = 64  # characters of a name or value from the store shown in a line (a node id is far shorter)
LOGGED_KEYS = 1024  # keys logged (each once); more are counted only


class MalformedRecord(ValueError):
    """A rendezvous record in the store that the slot rendezvous did not write (or not whole). A
    ValueError, not torch's RendezvousError: this module stays importable without torch (the
    drill's report reads arrival marks through it); torchrun's agent ends on it with this line."""


def shown(text: str, limit: int = SHOWN_MAX) -> str:
    """A name or value read from the rendezvous store, as a log line shows it: one line of
    printable ASCII, at most ``limit`` characters (then ``...``). On a TCPStore anyone who reaches
    the port writes there: a record's terminal escapes, line breaks (a forged ``rendezvous
    stalled:`` line, which the drill's report picks up) or megabytes must not reach the log."""
    text = printable(text)
    return text if len(text) <= limit else text[:limit] + "..."


def malformed(kind: str, key: str, raw: bytes | str, why: str) -> str:
    """Count one malformed value of ``kind`` read at ``key`` and log it (once per key); the line."""
    line = f"store key {key} holds {shown(_text(raw))!r}: {why} (not written by Sentinel's slot rendezvous)"
    with _lock:
        MALFORMED[kind] += 1
        first = key not in _logged and len(_logged) <= LOGGED_KEYS  # once full: counted only (a key
        if first:  # read every pass, e.g. latest, would otherwise log every pass; review s19)
            _logged.add(key)
    if first and len(_logged) > LOGGED_KEYS:
        log.warning("%s; more malformed keys than %d: the next ones are counted only", line, LOGGED_KEYS)
    elif first:
        log.warning("%s", line)
    return line


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _json(text: str) -> Any:
    """``text`` as JSON; None when it is not JSON. Nesting deeper than the interpreter's recursion
    limit (``[[[[...``, a few kB anyone can plant) raises RecursionError, not ValueError, from
    json.loads: read as not JSON too (review s19)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def arrival(raw: bytes | str) -> dict[str, Any] | None:
    """An arrival mark as its record; None for a ``LEFT`` mark or one that is not an arrival
    record (not JSON, not an object, no string ``id``)."""
    text = _text(raw)
    if text.startswith(LEFT):
        return None
    record = _json(text)
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


def arrival_id(raw: bytes | str) -> str:
    """The ``id`` of an arrival mark; ``?`` when it is not an arrival record (``LEFT`` marks included)."""
    record = arrival(raw)
    return record["id"] if record is not None else "?"


def owns(raw: bytes | str, node_id: str) -> bool:
    """Whether the arrival mark ``raw`` is node ``node_id``'s own: never for a ``LEFT`` mark or a
    value that is not an arrival record."""
    record = arrival(raw)
    return record is not None and record["id"] == node_id


def generation(raw: bytes | str, key: str) -> int:
    """The generation number stored at ``key`` (``latest``); :class:`MalformedRecord` otherwise."""
    text = _text(raw).strip()
    if text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text)
    raise MalformedRecord(malformed("latest", key, raw, "not a generation number"))


def record(raw: bytes | str, key: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """A JSON object stored at ``key`` with every field of ``fields``; :class:`MalformedRecord` otherwise."""
    value = _json(_text(raw))
    if not isinstance(value, dict) or any(f not in value for f in fields):
        raise MalformedRecord(malformed("record", key, raw, f"not a JSON object with {', '.join(fields)}"))
    return value


def next_generation(store: Any, key: str) -> int | None:
    """One more than the generation at ``key`` (``latest``) when it is there and a number; None
    when it is absent or malformed (counted, logged): a watcher's pass waits for its next turn."""
    if not store.check([key]):
        return None
    try:
        return generation(store.get(key), key) + 1
    except MalformedRecord:
        return None


def endpoint(raw: bytes | str | dict[str, Any], key: str) -> tuple[str, int]:
    """The (addr, port) of the record at ``key`` (an arrival record's or a generation's
    ``addr``/``port`` or ``master_addr``/``master_port``; raw or already parsed);
    :class:`MalformedRecord` otherwise."""
    value = raw if isinstance(raw, dict) else record(raw, key, ())
    addr, port = value.get("master_addr", value.get("addr")), value.get("master_port", value.get("port"))
    if isinstance(port, str) and port.isascii() and port.isdigit() and len(port) <= 5:
        port = int(port)
    if isinstance(addr, str) and addr and isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
        return addr, port
    raise MalformedRecord(malformed("record", key, json.dumps(value)[:200], "no valid address and port"))


def vacancy(raw: bytes | str, key: str, nodes: int) -> dict[str, Any] | None:
    """A vacancy (slot, gen, left) with its slot in range; None (counted, logged) otherwise."""
    value = _json(_text(raw))
    ok = (isinstance(value, dict) and all(isinstance(value.get(k), int) and not isinstance(value.get(k), bool)
                                          for k in ("slot", "gen"))
          and 0 <= value["slot"] < nodes and value["gen"] >= 1 and isinstance(value.get("left"), str))
    if not ok:
        malformed("vacancy", key, raw, f"not a vacancy (slot in 0..{nodes - 1}, gen, left)")
        return None
    return value
