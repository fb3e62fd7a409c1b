"""The slot format of the memory tier (pure: no torch, no I/O).

A slot is one file in a node's holder (see :mod:`trainer.memory.holder`): a 64-byte fixed header
(magic, version, state, step, data offset, data length, CRC32, meta length), a JSON meta block
(run id, world size, shard, layout hash, the non-tensor leaves of the state), then the tensor
bytes at a 4 KiB-aligned offset. A writer marks the slot WRITING before touching the data and
COMPLETE (with the step) only after; a slot found WRITING — its writer died mid-copy, or a
replica's sender died mid-transfer — is never loaded. A replica is COMPLETE only once the bytes
received match the sender's CRC32. A slot of another run id, world size or layout is stale and
never loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

MAGIC = b"SNTLMEM1"
VERSION = 1
EMPTY, WRITING, COMPLETE = 0, 1, 2
FIXED = struct.Struct("<8sIIqQQIII")  # magic version state step data_offset data_len crc has_crc meta_len
FIXED_LEN = 64
ALIGN = 4096
OWN_SLOTS = 3
REPLICA_SLOTS = 2
META_ROOM = 64 * 1024  # room for the JSON meta: the non-tensor leaves change between snapshots
OWN, REPLICA = "own", "replica"


class MemoryTierError(RuntimeError):
    """The memory tier cannot be used as configured; the message says why and what to change."""


class MemoryBudgetError(MemoryTierError):
    """Not enough room in a node's holder for its shards and its partner's replica."""


@dataclass(frozen=True)
class SlotInfo:
    """One slot's header as found in a holder (what the inventory reports)."""

    file: str
    role: str
    shard: int
    slot: int
    state: int
    step: int
    data_len: int
    crc: int | None
    meta: dict

    @property
    def run(self) -> str:
        return str(self.meta.get("run", ""))


def slot_name(role: str, shard: int, slot: int) -> str:
    return f"{role}-{shard:05d}-{slot}.mem"


def parse_name(name: str) -> tuple[str, int, int] | None:
    if not name.endswith(".mem"):
        return None
    parts = name[:-4].split("-")
    if len(parts) != 3 or parts[0] not in (OWN, REPLICA) or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def data_offset(meta_room: int = META_ROOM) -> int:
    return (FIXED_LEN + meta_room + ALIGN - 1) // ALIGN * ALIGN


def parse_header(raw: bytes) -> tuple[int, int, int | None, dict, int]:
    if len(raw) < FIXED_LEN:
        return EMPTY, -1, None, {}, 0
    magic, version, state, step, offset, data_len, crc, has_crc, meta_len = FIXED.unpack(raw[:FIXED.size])
    if magic != MAGIC or version != VERSION or state not in (EMPTY, WRITING, COMPLETE) or meta_len > len(raw) - FIXED_LEN:
        return EMPTY, -1, None, {}, 0
    meta: dict = {}
    if state == COMPLETE:
        try:
            meta = json.loads(raw[FIXED_LEN:FIXED_LEN + meta_len])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return EMPTY, -1, None, {}, 0
        if not isinstance(meta, dict):
            return EMPTY, -1, None, {}, 0
    return state, step, (crc if has_crc else None), meta, data_len
