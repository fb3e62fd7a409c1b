"""The memory tier: every rank's shard in node-local memory that outlives the worker, plus one
replica on another node.

Placement
---------
Rank ``r`` on node ``n`` (``n = r // L``, ``L`` ranks per node, torchrun's order) sends its shard
to the rank with the same local rank on node ``(n + 1) mod N`` and holds the shard of the same
local rank on node ``(n - 1) mod N``: a ring of nodes. Any single node can die and every shard
survives (its own copy or its replica); two *adjacent* nodes dying loses the shards of the first
one, and recovery falls back to the newest disk snapshot. (With ``N = 2`` the two nodes hold each
other's replicas.) NVIDIA's resiliency extension calls the same idea a clique with
``replication_jump = L`` and ``replication_factor = 2``; DLRover's flash checkpoint pairs nodes;
Gemini places replicas in groups of nodes. See README "Memory tier".

Parts, one per concern (each imports only those above it):

* :mod:`~trainer.memory.slot` — the slot format: header, names, :class:`SlotInfo` (pure);
* :mod:`~trainer.memory.plan` — restore planning and ring placement (pure: no torch, no I/O);
* :mod:`~trainer.memory.layout` — a state dict as tensors at fixed offsets of a slot;
* :mod:`~trainer.memory.place` — where a node's holder is: its directory, its owner, its id (pure);
* :mod:`~trainer.memory.holder` — a holder's inventory and the mapped slots;
* :mod:`~trainer.memory.replicator` — the background copy to the ring partner and the agreement;
* :mod:`~trainer.memory.tier` — :class:`MemoryTier`, one rank's side: setup, snapshot, restore.

The names below are importable from ``trainer.memory`` as before the split. They are loaded on
first use, so that ``trainer.memory.slot`` and ``trainer.memory.plan`` import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "slot": ("MAGIC", "VERSION", "EMPTY", "WRITING", "COMPLETE", "FIXED_LEN", "ALIGN", "OWN_SLOTS", "REPLICA_SLOTS",
             "META_ROOM", "OWN", "REPLICA", "MemoryTierError", "MemoryBudgetError", "SlotInfo", "slot_name",
             "parse_name", "data_offset"),
    "plan": ("DISK", "RestorePlan", "placed_partners", "plan_restore", "ring_partners"),
    "layout": ("Leaf", "Layout"),
    "place": ("default_holder_dir", "ensure_holder", "holder_id"),
    "holder": ("MADV_POPULATE_WRITE", "Slot", "inventory"),
    "replicator": ("CHUNK", "HEAD_BYTES", "Replicator"),
    "tier": ("RestoreResult", "MemoryTier"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
