"""The layout: one rank's state dict as a list of tensors at fixed offsets of a slot's data
region, and its non-tensor leaves as JSON values in the slot's meta."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from trainer.memory.slot import MemoryTierError



def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def walk(obj: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    if isinstance(obj, Mapping):
        for k in obj:
            yield from walk(obj[k], path + (k,))
    elif isinstance(obj, (list, tuple)) and not _is_leaf_seq(obj):
        for i, v in enumerate(obj):
            yield from walk(v, path + (i,))
    else:
        yield path, obj


def _is_leaf_seq(obj: Any) -> bool:
    """A list or tuple holding no tensor and no mapping is one value (betas, param name lists)."""
    return not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in obj)


def encode(v: Any) -> Any:
    if isinstance(v, tuple):
        return {"__tuple__": [encode(x) for x in v]}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    raise MemoryTierError(f"the memory tier cannot hold a state value of type {type(v).__name__}: {v!r}")


def decode(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"__tuple__"}:
        return tuple(decode(x) for x in v["__tuple__"])
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


def path_key(path: tuple) -> str:
    return json.dumps(list(path))


@dataclass(frozen=True)
class Leaf:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Layout:
    """Where each tensor of one rank's state lives in a slot's data region. Built from the live
    state dict; two layouts with one hash hold the same tensors (names, dtypes, local shapes)."""

    leaves: list[Leaf]
    value_keys: list[str]
    data_len: int
    hash: str

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> "Layout":
        leaves, values, offset = [], [], 0
        h = hashlib.sha256()
        for path, v in walk(state):
            key = path_key(path)
            if isinstance(v, torch.Tensor):
                t = local(v)
                n = t.numel() * t.element_size()
                leaves.append(Leaf(key, t.dtype, tuple(t.shape), offset, n))
                h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
                offset += (n + 63) // 64 * 64  # 64-byte aligned: a view of any dtype is legal
            else:
                values.append(key)
                h.update(f"{key}|value\n".encode())
        return cls(leaves, values, offset, h.hexdigest()[:32])

    def matches(self, state: Mapping[str, Any]) -> bool:
        return Layout.of(state).hash == self.hash

    def values(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {path_key(p): encode(v) for p, v in walk(state) if not isinstance(v, torch.Tensor)}

    def views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of each leaf in a uint8 data region (created once per slot, reused)."""
        return [data[lf.offset:lf.offset + lf.nbytes].view(lf.dtype).view(lf.shape) for lf in self.leaves]

    def stage(self, state: Mapping[str, Any], views: list[torch.Tensor]) -> None:
        i = 0
        for _, v in walk(state):
            if isinstance(v, torch.Tensor):
                views[i].copy_(local(v).detach())
                i += 1

    def restore_into(self, state: Mapping[str, Any], views: list[torch.Tensor], values: Mapping[str, Any]) -> None:
        """Copy a slot's tensors into the live state's tensors and set its non-tensor leaves."""
        i = 0
        for path, v in walk(state):
            if isinstance(v, torch.Tensor):
                with torch.no_grad():
                    local(v).copy_(views[i])
                i += 1
            else:
                key = path_key(path)
                if key in values:
                    set_path(state, path, decode(values[key]))

    def rebuild(self, template: Mapping[str, Any], tensors: list[Any], values: Mapping[str, Any]) -> Any:
        """A state dict shaped like ``template`` whose tensors are ``tensors`` (in leaf order) and
        whose other leaves come from ``values``: what the disk tier saves from a slot."""
        it = iter(tensors)

        def build(obj: Any, path: tuple) -> Any:
            if isinstance(obj, Mapping):
                return {k: build(obj[k], path + (k,)) for k in obj}
            if isinstance(obj, (list, tuple)) and not _is_leaf_seq(obj):
                return type(obj)(build(v, path + (i,)) for i, v in enumerate(obj))
            if isinstance(obj, torch.Tensor):
                return next(it)
            key = path_key(path)
            return decode(values[key]) if key in values else obj

        return build(template, ())


def get_path(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def copy_all(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """views[i] <- sources[i]: one copy per tensor, in one call where torch has it."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(views, sources)
    else:
        for dst, src in zip(views, sources):
            dst.copy_(src)


def set_path(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    if isinstance(obj, tuple):
        return  # immutable container: the live value stays (it is a leaf sequence in practice)
    obj[path[-1]] = value

