"""Batched NVML reads for :class:`sentinel.sources.nvml.NvmlSource`: nvmlDeviceGetFieldValues,
and the NVLink counters read link by link only when their totals moved.

:class:`FieldValues` finds, once per GPU, which field ids the driver answers, and reads them in
one call per chunk of ``FIELD_VALUES_PER_CALL`` entries, each entry's return code handled as
its own call's would be (not supported: left out for good; an error: counted, retried).
pynvml answers with a ctypes array, unpacked from its buffer in C (each union member as ctypes
reads it): ~0.3 µs an entry against ~0.9 through ctypes' attributes.

The NVLink error counters are most of a GPU's read (4 kinds x 18 links, data CRC on 12: 66 of
~85 values). Where the driver answers a kind's total (``NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL``,
"total for all lanes" in nvml.h) and every counter of that kind is a field value, the total is
read with the fields every poll, and that kind's per-link counters (:class:`LinkGate`) only when

* a total differs from the totals the last per-link read added up to (a counter that moves moves
  its kind's total; a reset, which sets counters back, too);
* a total could not be read, or the last per-link read was incomplete or did not add up to the
  totals read just before it (a counter moved between the two calls; or this driver's total is
  not the sum of these counters: then every poll reads them, as without totals);
* ``NVLINK_AUDIT_POLLS`` polls have passed since the last per-link read.

Otherwise the reading carries that last per-link read, which adds up, kind by kind, to the
totals read this poll. The rules see the counters summed per kind
(:attr:`sentinel.readings.GpuReading.nvlink_sums`): what a read of every link would have given.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable

from sentinel import fields as nvml_fields
from sentinel.readings import NVLINK_KINDS

NVLINK_COUNTERS = {  # kind -> the nvmlDeviceGetNvLinkErrorCounter counter, in the order a GPU's are read
    "replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}
assert set(NVLINK_COUNTERS) == set(NVLINK_KINDS) == set(nvml_fields.NVLINK_TOTAL_FIELD_IDS)
# (what, key, (fieldId, scopeId)): what is "field" (key: the field's name), "link" (key: (link,
# kind)) or "total" (key: the kind)
Entry = tuple[str, Any, tuple[int, int]]
NVLINK_AUDIT_POLLS = 60  # polls at most between two per-link reads, the totals unchanged


class _Code:
    """An NVML return code from one field value, recorded as an NVMLError would be."""

    def __init__(self, value: int) -> None:
        self.value = value


def entry_name(what: str, key: Any) -> str:
    """The name an entry's outcome is reported and counted under: the field's, ``nvlink_<kind>``
    for a link's counter, ``nvlink_<kind>_total`` for a total (counted, never in a reading)."""
    if what == "field":
        return key
    return f"nvlink_{key[1]}" if what == "link" else f"nvlink_{key}_total"


def _layout(fv_type: Any) -> struct.Struct | None:
    """(valueType, nvmlReturn, the value's 8 bytes as an unsigned 64-bit number) of each entry of a
    ctypes array of ``fv_type`` (pynvml's ``c_nvmlFieldValue_t``), unpacked from its buffer in C;
    None where the layout is not that one (or not little-endian): read entry by entry."""
    try:
        kind, ret, value = fv_type.valueType, fv_type.nvmlReturn, fv_type.value
    except AttributeError:
        return None
    size = ctypes.sizeof(fv_type)
    if sys.byteorder != "little" or (kind.size, ret.size, value.size) != (4, 4, 8) or \
            not kind.offset + 4 <= ret.offset and ret.offset + 4 <= value.offset and value.offset + 8 <= size:
        return None
    return struct.Struct(f"<{kind.offset}xI{ret.offset - kind.offset - 4}xI{value.offset - ret.offset - 4}xQ"
                         f"{size - value.offset - 8}x")


def _from_bits(union_type: Any, attrs: dict[int, str]) -> dict[int, Callable[[int], Any]]:
    """valueType -> the number its union member holds, from the union's 8 bytes (as ctypes reads it)."""
    members = dict(getattr(union_type, "_fields_", ()))
    out: dict[int, Callable[[int], Any]] = {}
    for kind, attr in attrs.items():
        ctype = members.get(attr)
        if ctype is None:
            continue
        size = ctypes.sizeof(ctype)
        if ctype._type_ in ("d", "f"):
            code = "<d" if size == 8 else "<f"
            out[kind] = lambda bits, code=code, size=size: struct.unpack(code, bits.to_bytes(8, "little")[:size])[0]
        else:
            mask, signed = (1 << 8 * size) - 1, ctype(-1).value < 0
            out[kind] = (lambda bits, mask=mask, top=1 << (8 * size - 1):
                         (bits & mask) - 2 * top if bits & mask >= top else bits & mask) if signed else \
                (lambda bits, mask=mask: bits & mask)
    return out


def _chunks(entries: list[Entry]) -> list[list[Entry]]:
    step = nvml_fields.FIELD_VALUES_PER_CALL
    return [entries[i:i + step] for i in range(0, len(entries), step)]


@dataclass
class LinkGate:
    """One GPU's per-link NVLink counters of the ``kinds`` whose totals it reads (see the module)."""

    kinds: frozenset[str]
    chunks: list[list[Entry]]  # the per-link counters of those kinds, as field values
    count: int  # how many
    totals: dict[str, int] | None = None  # the newest totals read; None: one could not be read
    seen_totals: dict[str, int] | None = None  # the totals the last per-link read added up to
    seen: dict[tuple[int, str], int] | None = None  # that read's counters
    polls_left: int = 0  # polls the per-link read may still be skipped

    def fresh(self) -> bool:
        """Whether the last per-link read stands for this poll (and one fewer poll may skip it)."""
        if self.seen is None or self.totals is None or self.totals != self.seen_totals or self.polls_left <= 0:
            return False
        self.polls_left -= 1
        return True

    def settle(self, links: dict[tuple[int, str], int] | None) -> None:
        """After a per-link read (None: cut off by a lost GPU): kept when complete and adding up to
        the totals read before it; else the next poll reads the links again."""
        if links is not None and self.totals is not None and len(links) == self.count:
            sums = dict.fromkeys(self.kinds, 0)
            for (_, kind), value in links.items():
                sums[kind] += value
            if sums == self.totals:
                self.seen_totals, self.seen, self.polls_left = self.totals, links, NVLINK_AUDIT_POLLS
                return
        self.seen_totals = self.seen = None


class FieldValues:
    """Probes and reads one GPU's field values. ``record_error(gpu, name, exc)`` counts a failed
    entry (``exc.value`` is its NVML code); ``totals`` False reads every NVLink counter every poll.

    A GPU (:class:`sentinel.sources.nvml._Gpu`) carries what the probe found: ``batch`` (chunks of
    entries read every poll: the fields, the totals, the links of kinds without one) and
    ``links`` (a :class:`LinkGate`, or None)."""

    def __init__(self, nvml: Any, record_error: Callable[[Any, str, Any], None], *, totals: bool = True) -> None:
        self.nvml = nvml
        self.record_error = record_error
        self.totals = totals
        self.declared = {f.name: f for f in nvml_fields.NVML_FIELDS}
        self._attrs = nvml_fields.value_attrs(nvml)
        self._success = getattr(nvml, "NVML_SUCCESS", 0)
        self._lost = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15)
        self._ull = getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3)
        plain = (nvml_fields.NUMBER, nvml_fields.FLAG)  # None: the number as a float, as these decode it
        self._decoders = {f.name: None if f.value_codec in plain else f.value_codec.decode
                          for f in nvml_fields.NVML_FIELDS}
        self._layouts: dict[Any, tuple[struct.Struct, dict[int, Callable[[int], Any]]] | None] = {}

    def _unpacked(self, values: Any) -> tuple[Any, dict[int, Callable[[int], Any]]] | None:
        """(rows of (valueType, nvmlReturn, value bits), bits -> number by valueType) for pynvml's
        ctypes array (~0.3 us an entry, against ~0.9 through ctypes' attributes); None otherwise."""
        if not isinstance(values, ctypes.Array):
            return None
        fv_type = values._type_
        if fv_type not in self._layouts:
            layout = _layout(fv_type)
            self._layouts[fv_type] = None if layout is None else (layout, _from_bits(dict(fv_type._fields_)["value"],
                                                                                     self._attrs))
        hit = self._layouts[fv_type]
        return None if hit is None else (hit[0].iter_unpack(bytes(values)), hit[1])

    def probe(self, gpu: Any) -> tuple[set[str], set[str]]:
        """Try every field id (and NVLink counter and total) once; keep in ``gpu.batch`` what the
        driver answers (or fails on with anything but NOT_SUPPORTED: retried, as any field is; a
        total only when answered). Returns (fields batched, fields whose id the driver does not
        support). A driver without the call, or one whose call fails as a whole, leaves every
        field to its own call."""
        nvml = self.nvml
        fn = getattr(nvml, "nvmlDeviceGetFieldValues", None)
        wanted: list[Entry] = []
        for name, f in self.declared.items():
            fid = getattr(nvml, f.field_id, None) if f.field_id else None
            if fid is not None:
                wanted.append(("field", name, (int(fid), 0)))
        for link in gpu.nvlinks:
            for kind in NVLINK_COUNTERS:
                spec = nvml_fields.nvlink_field_id(nvml, link, kind)
                if spec is not None:
                    wanted.append(("link", (link, kind), spec))
        if self.totals and gpu.nvlinks:
            wanted += [("total", kind, spec) for kind in NVLINK_COUNTERS
                       if (spec := nvml_fields.nvlink_total_field_id(nvml, kind)) is not None]
        if fn is None or not wanted:
            return set(), set()
        kept: list[Entry] = []
        unsupported: set[str] = set()
        for chunk in _chunks(wanted):
            try:
                values = gpu.calls.call(fn, gpu.handle, [spec for _, _, spec in chunk])
            except nvml.NVMLError as exc:
                if exc.value not in (nvml.NVML_ERROR_NOT_SUPPORTED, getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", -1)):
                    self.record_error(gpu, "field_values", exc)
                return set(), set()
            for (what, key, spec), fv in zip(chunk, values):
                ret = int(fv.nvmlReturn)
                if what == "total":
                    if ret == nvml.NVML_SUCCESS:
                        kept.append((what, key, spec))
                    continue
                if ret == nvml.NVML_ERROR_NOT_SUPPORTED:
                    if what == "field":
                        unsupported.add(key)
                    continue
                if ret != nvml.NVML_SUCCESS:
                    self.record_error(gpu, entry_name(what, key), _Code(ret))
                kept.append((what, key, spec))
        gpu.batch = _chunks(kept)
        return {key for what, key, _ in kept if what == "field"}, unsupported

    def gate(self, gpu: Any, link_calls: list[tuple[int, str]]) -> None:
        """After the probe: the kinds with a total and every counter a field value have their
        per-link counters read by ``gpu.links``; the other totals are dropped from the batch."""
        entries = [e for chunk in gpu.batch for e in chunk]
        kinds = {key for what, key, _ in entries if what == "total"} - {kind for _, kind in link_calls}
        kinds &= {key[1] for what, key, _ in entries if what == "link"}  # a total of no counter read gates nothing
        gated = [e for e in entries if e[0] == "link" and e[1][1] in kinds]
        # the totals first: one chunk reads them all (a poll compares them together)
        gpu.batch = _chunks([e for e in entries if e[0] == "total" and e[1] in kinds]
                            + [e for e in entries if e[0] == "field" or (e[0] == "link" and e[1][1] not in kinds)])
        gpu.links = LinkGate(frozenset(kinds), _chunks(gated), len(gated)) if kinds else None

    def read(self, gpu: Any, chunk: list[Entry], read: Any, links: dict | None = None) -> bool:
        """One nvmlDeviceGetFieldValues call into ``read`` (a PollRead); each entry's outcome is its
        field's, a total's is ``gpu.links``'s; the NVLink counters read are also added to
        ``links``. True when the GPU is lost."""
        nvml = self.nvml
        try:
            values = gpu.calls.call(nvml.nvmlDeviceGetFieldValues, gpu.handle, [spec for _, _, spec in chunk])
        except nvml.NVMLError as exc:
            for what, key, _ in chunk:
                if what == "total":
                    gpu.links.totals = None  # the per-link read follows, and fails or reports
                    continue
                name = entry_name(what, key)
                read.put("errors", name, int(exc.value))
                self.record_error(gpu, name, exc)
            return exc.value == nvml.NVML_ERROR_GPU_IS_LOST
        # ~20 values a GPU a poll (85 when the links are read): the constants, the value-type map and
        # the decoders are looked up once, the common case (an unsigned long long) takes no look-up,
        # the results are handed over under one lock
        success, lost_code, attrs, ull, decoders = self._success, self._lost, self._attrs, self._ull, self._decoders
        lost = totals_read = False
        values_out: dict[str, float] = {}
        links_out: dict[tuple[int, str], int] = {}
        errors_out: dict[str, int] = {}
        totals: dict[str, int] = {}
        unpacked = self._unpacked(values)
        rows, from_bits = unpacked if unpacked is not None else (((fv.valueType, fv.nvmlReturn, fv) for fv in values), None)
        for (what, key, spec), (kind, ret, raw) in zip(chunk, rows):
            totals_read = totals_read or what == "total"
            if ret != success:
                name = entry_name(what, key)
                if what != "total":
                    errors_out[name] = int(ret)
                self.record_error(gpu, name, _Code(int(ret)))
                lost = lost or ret == lost_code
                continue
            if from_bits is not None:  # raw: the value's bits
                if kind == ull:
                    number = raw
                elif kind in from_bits:
                    number = from_bits[kind](raw)
                else:
                    raise ValueError(f"field {spec[0]}: unknown NVML value type {kind}")
            elif kind == ull:  # raw: the entry
                number = raw.value.ullVal
            elif kind in attrs:
                number = getattr(raw.value, attrs[kind])
            else:
                raise ValueError(f"field {raw.fieldId}: unknown NVML value type {kind}")
            if what == "field":
                decode = decoders[key]
                values_out[key] = float(number) if decode is None else float(decode(nvml, float(number)))
            elif what == "link":
                links_out[key] = int(number)
            else:
                totals[key] = int(number)
        if totals_read:
            gpu.links.totals = totals if len(totals) == len(gpu.links.kinds) else None
        if links is not None:
            links.update(links_out)
        read.put_many(values_out, errors_out, links_out)
        return lost

    def read_links(self, gpu: Any, read: Any) -> bool:
        """The per-link counters of ``gpu.links``' kinds into ``read``: those of the last per-link read
        while it stands (:meth:`LinkGate.fresh`), else read now. True when the GPU is lost."""
        gate = gpu.links
        if gate.fresh():
            read.put_many({}, {}, gate.seen)
            return False
        links: dict[tuple[int, str], int] = {}
        for chunk in gate.chunks:
            if self.read(gpu, chunk, read, links):
                gate.settle(None)
                return True
        gate.settle(links)
        return False
