"""NVML fields, declared once.

Each scalar per-GPU field is one :class:`NvmlField` in :data:`NVML_FIELDS`. Everything else is
derived from that table, so a new field is one declaration here:

* :data:`sentinel.readings.FIELDS` (the names, in probe order);
* the reader :class:`sentinel.sources.nvml.NvmlSource` calls (:meth:`NvmlField.read`);
* the Prometheus metric the collector in :mod:`sentinel.metrics` exports (:func:`metric_table`);
* the simulated backend: where its state file keeps the value, the value of a healthy GPU, and
  the pynvml look-alike function that serves it (:func:`serve`);
* the test fake of pynvml (``tests/fake_pynvml.py``), which serves the same look-alike functions;
* the batched read: a field with a ``field_id`` (an ``NVML_FI_*`` constant) is read with every other
  such field, and the NVLink counters, in one ``nvmlDeviceGetFieldValues`` call per GPU per poll
  (:func:`nvlink_field_id` for the counters); the field's ``call`` is the fallback where the
  driver does not answer the field id. A field with a ``field_id`` and no ``call`` (the GPU
  recovery action) exists only as a field value.

A declaration names the pynvml function and the pynvml constants passed after the handle, so
several fields can share one call (``nvmlDeviceGetTotalEccErrors`` by error and counter type),
or one call's composite result (``nvmlDeviceGetRemappedRows`` returns a tuple: ``part`` is the
index; ``nvmlDeviceGetRowRemapperHistogram`` a struct: ``part`` is the attribute). A
:class:`Codec` turns the raw result into the reading's float and back (the look-alikes need the
way back). The constants are looked up on the injected module, so this file imports no pynvml.

Nothing here does I/O. :func:`check` raises :class:`FieldDeclarationError` for a table whose
declarations contradict each other; the built-in table is checked at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Literal, Sequence

from sentinel.families import Family


class FieldDeclarationError(ValueError):
    """Two declarations contradict each other, or one is incomplete."""


@dataclass(frozen=True)
class Codec:
    """How a raw pynvml result (or one part of it) maps to a reading, and back.

    ``decode(nvml, raw) -> float`` is what the source reports. ``encode(nvml, value) -> raw`` is
    what a look-alike returns for a stored value (a number or a bool in the simulator's state).
    """

    decode: Callable[[Any, Any], float]
    encode: Callable[[Any, Any], Any]


NUMBER = Codec(decode=lambda nvml, raw: float(raw), encode=lambda nvml, value: int(value))
FLAG = Codec(decode=lambda nvml, raw: float(raw), encode=lambda nvml, value: int(bool(value)))  # 0/1
FEATURE_ENABLED = Codec(  # NVML_FEATURE_ENABLED / _DISABLED, reported as 1 / 0
    decode=lambda nvml, raw: float(raw == nvml.NVML_FEATURE_ENABLED),
    encode=lambda nvml, value: nvml.NVML_FEATURE_ENABLED if value else nvml.NVML_FEATURE_DISABLED,
)
LIST_LENGTH = Codec(  # a list of page addresses, reported as its length
    decode=lambda nvml, raw: float(len(raw)),
    encode=lambda nvml, value: [0x1000 * (i + 1) for i in range(int(value))],
)
MILLI = Codec(  # milliwatts, reported in watts (base units)
    decode=lambda nvml, raw: raw / 1000.0,
    encode=lambda nvml, value: int(float(value) * 1000),
)


@dataclass(frozen=True)
class NvmlField:
    """One scalar per-GPU field: how to read it, how to export it, how to simulate it.

    ``call`` is the pynvml function; ``args`` the names of the pynvml constants passed after the
    handle; ``older_calls`` the names the same function had in older pynvml releases (tried in
    order when ``call`` is missing). ``part`` picks one element (an int index) or attribute (a
    name) of a composite result. ``metric`` / ``kind`` / ``help`` / ``labels`` make the
    Prometheus sample; fields sharing a metric give their help once (the others leave it empty)
    and differ by their labels. ``sim_path`` is where the simulated state file keeps the value
    (default: the field's name at the GPU's top level) and ``sim_default`` its value on a
    healthy GPU. ``monotonic`` says the value only grows until a reset (a counter in NVML's
    sense, whatever the metric type); it is documentation for rules that detect resets.
    """

    name: str
    call: str
    metric: str
    help: str = ""
    kind: Literal["counter", "gauge"] = "gauge"
    labels: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    part: int | str | None = None
    codec: Codec = NUMBER
    older_calls: tuple[str, ...] = ()
    sim_path: tuple[str, ...] = ()
    sim_default: float | int | bool = 0
    monotonic: bool = False
    field_id: str = ""  # the NVML_FI_* constant that reads it through nvmlDeviceGetFieldValues (batched)
    field_codec: Codec | None = None  # the field value's number -> reading (default: as the call's codec would be NUMBER)
    omit_zero: bool = False  # export only where nonzero (an "all is well" series a fleet need not scrape)

    @property
    def state_path(self) -> tuple[str, ...]:
        return self.sim_path or (self.name,)

    def function(self, nvml: Any) -> Callable[..., Any]:
        """The pynvml function to call: ``call``, or the first of ``older_calls`` ``nvml`` has."""
        for name in (self.call, *self.older_calls):
            fn = getattr(nvml, name, None)
            if fn is not None:
                return fn
        raise AttributeError(f"{self.name}: the NVML module has none of {', '.join((self.call, *self.older_calls))}")

    @property
    def value_codec(self) -> Codec:
        """How the number nvmlDeviceGetFieldValues returns maps to the reading (and back)."""
        return self.field_codec or NUMBER

    def read(self, nvml: Any, handle: Any) -> float:
        """The reading, through ``nvml`` (pynvml, the simulated backend or a fake); raises NVMLError."""
        raw = self.function(nvml)(handle, *(getattr(nvml, a) for a in self.args))
        return float(self.codec.decode(nvml, pick(raw, self.part)))


def pick(raw: Any, part: int | str | None) -> Any:
    if part is None:
        return raw
    return raw[part] if isinstance(part, int) else getattr(raw, part)


_ECC = "nvmlDeviceGetTotalEccErrors"
_CORRECTED, _UNCORRECTED = "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"
_VOLATILE, _AGGREGATE = "NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC"
_ROWS, _BANKS = "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRowRemapperHistogram"
_ROWS_HELP = "Remapped memory rows by kind (pending/failure are 0/1)"


def _ecc(kind: str, scope: str, err: str, counter: str, field_id: str, help_: str = "") -> NvmlField:
    return NvmlField(f"ecc_{kind}_{scope}", _ECC, "sentinel_gpu_ecc_errors", help_, "counter",
                     (("type", kind), ("scope", scope)), (err, counter), sim_path=("ecc", f"{kind}_{scope}"), monotonic=True,
                     field_id=field_id)


def _banks(availability: str, default: int = 0, help_: str = "") -> NvmlField:
    return NvmlField(f"remap_histogram_{availability}", _BANKS, "sentinel_gpu_row_remapper_banks", help_,
                     labels=(("availability", availability),), part=availability,
                     sim_path=("remap_histogram", availability), sim_default=default)


# In probe order (the order a slow GPU's fields are read in, and the order of FIELDS).
NVML_FIELDS: tuple[NvmlField, ...] = (
    _ecc("corrected", "volatile", _CORRECTED, _VOLATILE, "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", "ECC errors reported by NVML"),
    _ecc("uncorrected", "volatile", _UNCORRECTED, _VOLATILE, "NVML_FI_DEV_ECC_DBE_VOL_TOTAL"),
    _ecc("corrected", "aggregate", _CORRECTED, _AGGREGATE, "NVML_FI_DEV_ECC_SBE_AGG_TOTAL"),
    _ecc("uncorrected", "aggregate", _UNCORRECTED, _AGGREGATE, "NVML_FI_DEV_ECC_DBE_AGG_TOTAL"),
    NvmlField("retired_pages_sbe", "nvmlDeviceGetRetiredPages", "sentinel_gpu_retired_pages",
              "Retired framebuffer pages by cause", labels=(("cause", "sbe"),),
              args=("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",), codec=LIST_LENGTH,
              sim_path=("retired_pages", "sbe"), monotonic=True, field_id="NVML_FI_DEV_RETIRED_SBE"),
    NvmlField("retired_pages_dbe", "nvmlDeviceGetRetiredPages", "sentinel_gpu_retired_pages",
              labels=(("cause", "dbe"),), args=("NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",),
              codec=LIST_LENGTH, sim_path=("retired_pages", "dbe"), monotonic=True, field_id="NVML_FI_DEV_RETIRED_DBE"),
    NvmlField("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", "sentinel_gpu_retired_pages_pending",
              "1 when a page retirement awaits a reset", codec=FEATURE_ENABLED,
              sim_path=("retired_pages", "pending"), sim_default=False, field_id="NVML_FI_DEV_RETIRED_PENDING", field_codec=FLAG),
    NvmlField("remapped_rows_correctable", _ROWS, "sentinel_gpu_remapped_rows", _ROWS_HELP,
              labels=(("kind", "correctable"),), part=0, sim_path=("remapped_rows", "correctable"), monotonic=True, field_id="NVML_FI_DEV_REMAPPED_COR"),
    NvmlField("remapped_rows_uncorrectable", _ROWS, "sentinel_gpu_remapped_rows", labels=(("kind", "uncorrectable"),),
              part=1, sim_path=("remapped_rows", "uncorrectable"), monotonic=True, field_id="NVML_FI_DEV_REMAPPED_UNC"),
    NvmlField("remapped_rows_pending", _ROWS, "sentinel_gpu_remapped_rows", labels=(("kind", "pending"),),
              part=2, codec=FLAG, sim_path=("remapped_rows", "pending"), sim_default=False, field_id="NVML_FI_DEV_REMAPPED_PENDING",
              field_codec=FLAG),
    NvmlField("remapped_rows_failure", _ROWS, "sentinel_gpu_remapped_rows", labels=(("kind", "failure"),),
              part=3, codec=FLAG, sim_path=("remapped_rows", "failure"), sim_default=False, field_id="NVML_FI_DEV_REMAPPED_FAILURE",
              field_codec=FLAG),
    _banks("max", 640, "Memory banks by remaining remap availability"),
    _banks("high"),
    _banks("partial"),
    _banks("low"),
    _banks("none"),
    NvmlField("pcie_replay", "nvmlDeviceGetPcieReplayCounter", "sentinel_gpu_pcie_replay", "PCIe replay counter",
              "counter", sim_path=("pcie", "replay"), monotonic=True, field_id="NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
    NvmlField("pcie_link_gen", "nvmlDeviceGetCurrPcieLinkGeneration", "sentinel_gpu_pcie_link_generation",
              "Current PCIe link generation", sim_path=("pcie", "gen"), sim_default=5),
    NvmlField("pcie_link_width", "nvmlDeviceGetCurrPcieLinkWidth", "sentinel_gpu_pcie_link_width_lanes",
              "Current PCIe link width", sim_path=("pcie", "width"), sim_default=16),
    NvmlField("temperature_celsius", "nvmlDeviceGetTemperature", "sentinel_gpu_temperature_celsius",
              "GPU core temperature", args=("NVML_TEMPERATURE_GPU",), sim_default=38),
    NvmlField("slowdown_temperature_celsius", "nvmlDeviceGetTemperatureThreshold",
              "sentinel_gpu_slowdown_temperature_celsius", "Temperature at which the GPU slows down",
              args=("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",), sim_default=87),
    NvmlField("power_watts", "nvmlDeviceGetPowerUsage", "sentinel_gpu_power_watts", "Power draw",
              codec=MILLI, sim_default=120.0, field_id="NVML_FI_DEV_POWER_AVERAGE", field_codec=MILLI),
    NvmlField("throttle_reasons", "nvmlDeviceGetCurrentClocksEventReasons", "sentinel_gpu_clock_event_reasons",
              "NVML clock event (throttle) reasons bitmask", older_calls=("nvmlDeviceGetCurrentClocksThrottleReasons",)),
    # Drivers >= 570: what the driver says the GPU needs (NVML_GPU_RECOVERY_ACTION_*). Field id 230 in
    # nvml.h and nvidia-ml-py 13 (NVIDIA's resiliency extension reads the same field).
    NvmlField("recovery_action", "", "sentinel_gpu_recovery_action",
              "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION where it is not 0 (none): 1 GPU reset, 2 node reboot, "
              "3 drain P2P, 4 drain and reset", field_id="NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", omit_zero=True),
)


def names(fields: Sequence[NvmlField]) -> tuple[str, ...]:
    return tuple(f.name for f in fields)


def metric_help(fields: Sequence[NvmlField], metric: str) -> str:
    """The help text of ``metric``: the one its fields declare."""
    return next((f.help for f in fields if f.metric == metric and f.help), "")


def metric_table(fields: Sequence[NvmlField]) -> dict[str, tuple[str, str, dict[str, str], bool]]:
    """field -> (metric name, help, extra labels, counter?), as the collector renders them."""
    return {f.name: (f.metric, metric_help(fields, f.metric), dict(f.labels), f.kind == "counter") for f in fields}


def families(fields: Sequence[NvmlField]) -> tuple[Family, ...]:
    """The metric families ``fields`` export, one per metric, labels ``gpu, uuid`` + the fields' own."""
    out: dict[str, Family] = {}
    for f in fields:
        if f.metric not in out:
            out[f.metric] = Family(f.metric, f.kind, metric_help(fields, f.metric), ("gpu", "uuid", *(k for k, _ in f.labels)))
    return tuple(out.values())


def calls(fields: Sequence[NvmlField]) -> frozenset[str]:
    """The pynvml functions a look-alike must provide to serve ``fields`` (besides
    nvmlDeviceGetFieldValues, see :func:`serve_field_values`)."""
    return frozenset(f.call for f in fields if f.call)


# NVLink error counters as field values: scopeId = the link. NVML has no data-CRC field per link
# beyond the 12 legacy per-link ids (NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L0..L11): those
# counters are read with nvmlDeviceGetNvLinkErrorCounter, one call each, where supported.
NVLINK_FIELD_IDS = {"replay": "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY", "recovery": "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY",
                    "crc_flit": "NVML_FI_DEV_NVLINK_ERROR_DL_CRC"}
NVLINK_LEGACY_LINKS = 12
FIELD_VALUES_PER_CALL = 128  # entries per nvmlDeviceGetFieldValues call
# Each kind's counter summed over the GPU's links ("total for all lanes", nvml.h), one field value
# each: the source reads these every poll and the per-link counters when a total moved (see
# sentinel/sources/nvml_batch.py).
NVLINK_TOTAL_FIELD_IDS = {"crc_flit": "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
                          "crc_data": "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
                          "replay": "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
                          "recovery": "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"}


def nvlink_total_field_id(nvml: Any, kind: str) -> tuple[int, int] | None:
    """(fieldId, 0) that reads one NVLink counter kind summed over the links, or None when NVML has none."""
    fid = getattr(nvml, NVLINK_TOTAL_FIELD_IDS.get(kind, ""), None)
    return None if fid is None else (int(fid), 0)


def nvlink_field_id(nvml: Any, link: int, kind: str) -> tuple[int, int] | None:
    """(fieldId, scopeId) that reads one NVLink counter as a field value, or None when NVML has none."""
    if kind in NVLINK_FIELD_IDS:
        fid = getattr(nvml, NVLINK_FIELD_IDS[kind], None)
        return None if fid is None else (int(fid), link)
    if kind == "crc_data" and link < NVLINK_LEGACY_LINKS:
        fid = getattr(nvml, f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{link}", None)
        return None if fid is None else (int(fid), 0)
    return None


_VALUE_TYPES = (("NVML_VALUE_TYPE_DOUBLE", 0, "dVal"), ("NVML_VALUE_TYPE_UNSIGNED_INT", 1, "uiVal"),
                ("NVML_VALUE_TYPE_UNSIGNED_LONG", 2, "ulVal"), ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3, "ullVal"),
                ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4, "sllVal"), ("NVML_VALUE_TYPE_SIGNED_INT", 5, "siVal"),
                ("NVML_VALUE_TYPE_UNSIGNED_SHORT", 6, "usVal"))


def value_attrs(nvml: Any) -> dict[int, str]:
    """valueType -> the member of nvmlValue_t that holds it, for this NVML module (look it up once)."""
    return {int(getattr(nvml, name, default)): attr for name, default, attr in _VALUE_TYPES}


def make_field_value(nvml: Any, field_id: int, scope: int, ret: int, number: float | int = 0) -> SimpleNamespace:
    """A look-alike nvmlFieldValue_t (for the simulated backend and the test fake)."""
    whole = float(number).is_integer()
    value = SimpleNamespace(dVal=float(number), uiVal=int(number), ulVal=int(number), ullVal=int(number),
                            sllVal=int(number), siVal=int(number), usVal=int(number))
    return SimpleNamespace(fieldId=field_id, scopeId=scope, timestamp=0, latencyUsec=0, nvmlReturn=ret, value=value,
                           valueType=nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG if whole else nvml.NVML_VALUE_TYPE_DOUBLE)


def field_values(nvml: Any, rows: Sequence[tuple[int, int, int, float | int]]) -> Any:
    """What nvmlDeviceGetFieldValues returns for ``rows`` of (field id, scope id, nvmlReturn,
    number): pynvml's own ctypes array of ``c_nvmlFieldValue_t``, so a reader pays what it pays
    on a driver's answer (~1 µs an entry through ctypes, ~6x a plain object's); look-alikes
    (:func:`make_field_value`) where ``nvml`` has no such type."""
    struct = getattr(nvml, "c_nvmlFieldValue_t", None)
    if struct is None:
        return [make_field_value(nvml, *row) for row in rows]
    out = (struct * len(rows))()
    for fv, (fid, scope, ret, number) in zip(out, rows):
        fv.fieldId, fv.scopeId, fv.nvmlReturn = fid, scope, ret
        if not float(number).is_integer():
            fv.valueType, fv.value.dVal = nvml.NVML_VALUE_TYPE_DOUBLE, float(number)
        elif number < 0:
            fv.valueType, fv.value.sllVal = nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, int(number)
        else:
            fv.valueType, fv.value.ullVal = nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, int(number)
    return out


def serve_field_values(fields: Sequence[NvmlField], nvml: Any, requests: Sequence[Any],
                       scalar: Callable[[NvmlField], tuple[int, Any]],
                       nvlink: Callable[[int, str], tuple[int, Any]], links: Sequence[int] = ()) -> Any:
    """For a look-alike of nvmlDeviceGetFieldValues: one field value per request (a field id, or
    a (field id, scope id) pair), as :func:`field_values` makes them. ``scalar(field)`` / ``nvlink(link, kind)`` return (nvmlReturn,
    stored value); a field id nothing declares answers NOT_SUPPORTED, as NVML does. An NVLink
    total is ``nvlink(link, kind)`` summed over ``links`` (the GPU's enabled links): NOT_SUPPORTED
    where no link has the counter, the first error where one fails."""
    by_id = {int(getattr(nvml, f.field_id)): f for f in fields if f.field_id and hasattr(nvml, f.field_id)}
    link_kinds = {int(getattr(nvml, c)): k for k, c in NVLINK_FIELD_IDS.items() if hasattr(nvml, c)}
    legacy = {int(getattr(nvml, f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{i}")): i for i in range(NVLINK_LEGACY_LINKS)
              if hasattr(nvml, f"NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L{i}")}
    totals = {int(getattr(nvml, c)): k for k, c in NVLINK_TOTAL_FIELD_IDS.items() if hasattr(nvml, c)}
    out = []
    for req in requests:
        fid, scope = (int(req[0]), int(req[1])) if isinstance(req, tuple) else (int(req), 0)
        if fid in by_id:
            f = by_id[fid]
            ret, stored = scalar(f)
            number = f.value_codec.encode(nvml, stored) if ret == nvml.NVML_SUCCESS else 0
        elif fid in totals:
            ret, number = _nvlink_total(nvml, [nvlink(link, totals[fid]) for link in links])
        elif fid in link_kinds or fid in legacy:
            link, kind = (scope, link_kinds[fid]) if fid in link_kinds else (legacy[fid], "crc_data")
            ret, number = nvlink(link, kind)
        else:
            ret, number = nvml.NVML_ERROR_NOT_SUPPORTED, 0
        out.append((fid, scope, ret, number if ret == nvml.NVML_SUCCESS else 0))
    return field_values(nvml, out)


def _nvlink_total(nvml: Any, answers: list[tuple[int, Any]]) -> tuple[int, int]:
    """(nvmlReturn, sum) of one kind's per-link answers, as NVML's total of that kind answers."""
    failed = [ret for ret, _ in answers if ret not in (nvml.NVML_SUCCESS, nvml.NVML_ERROR_NOT_SUPPORTED)]
    if failed:
        return failed[0], 0
    read = [int(n) for ret, n in answers if ret == nvml.NVML_SUCCESS]
    return (nvml.NVML_SUCCESS, sum(read)) if read else (nvml.NVML_ERROR_NOT_SUPPORTED, 0)


def serve(fields: Sequence[NvmlField], nvml: Any, call: str, args: tuple[Any, ...],
          value: Callable[[NvmlField], Any]) -> tuple[list[NvmlField], Callable[[], Any]]:
    """For a look-alike of ``call(handle, *args)``: the fields that call reads, and a function
    building its raw result from ``value(field)`` (each field's stored value, encoded by its
    codec). ``args`` are constant values; they are matched against the fields' constant names
    looked up on ``nvml``. No field: an empty list (the look-alike raises INVALID_ARGUMENT).
    """
    group = [f for f in fields if f.call == call and tuple(getattr(nvml, a) for a in f.args) == tuple(args)]

    def build() -> Any:
        parts = {f.part: f.codec.encode(nvml, value(f)) for f in group}
        if None in parts:
            return parts[None]
        if all(isinstance(p, int) for p in parts):
            return tuple(parts.get(i, 0) for i in range(max(parts) + 1))  # type: ignore[type-var, arg-type]
        return SimpleNamespace(**parts)

    return group, build


def check(fields: Iterable[NvmlField]) -> None:
    """Raise FieldDeclarationError when declarations contradict each other or lack something."""
    fields = tuple(fields)
    seen: dict[str, NvmlField] = {}
    by_metric: dict[str, list[NvmlField]] = {}
    by_call: dict[tuple[str, tuple[str, ...]], list[NvmlField]] = {}
    paths: dict[tuple[str, ...], str] = {}
    for f in fields:
        if not f.name or not (f.call or f.field_id) or not f.metric:
            raise FieldDeclarationError(f"{f.name or f!r}: a field needs a name, a pynvml call or field id, and a metric")
        if f.name in seen:
            raise FieldDeclarationError(f"{f.name}: declared twice")
        seen[f.name] = f
        if f.kind not in ("counter", "gauge"):
            raise FieldDeclarationError(f"{f.name}: kind must be counter or gauge, not {f.kind!r}")
        label_names = [k for k, _ in f.labels]
        if {"gpu", "uuid"} & set(label_names) or len(set(label_names)) != len(label_names):
            raise FieldDeclarationError(f"{f.name}: labels repeat one another or gpu/uuid")
        by_metric.setdefault(f.metric, []).append(f)
        if f.call:
            by_call.setdefault((f.call, f.args), []).append(f)
        for path, other in paths.items():
            shorter = min(len(path), len(f.state_path))
            if path[:shorter] == f.state_path[:shorter]:
                raise FieldDeclarationError(f"{f.name}: simulated state path {'/'.join(f.state_path)} overlaps {other}'s")
        paths[f.state_path] = f.name
    for metric, group in by_metric.items():
        first = group[0]
        if any(f.kind != first.kind or [k for k, _ in f.labels] != [k for k, _ in first.labels] for f in group):
            raise FieldDeclarationError(f"{metric}: its fields disagree on the metric type or label names")
        if len({f.labels for f in group}) != len(group):
            raise FieldDeclarationError(f"{metric}: two fields export the same series (same labels)")
        if len({f.help for f in group if f.help}) != 1:
            raise FieldDeclarationError(f"{metric}: exactly one help text, given by one or more of its fields")
    for (call, _), group in by_call.items():
        parts = [f.part for f in group]
        if len(group) > 1 and (None in parts or len(set(parts)) != len(parts)):
            raise FieldDeclarationError(f"{call}: fields sharing one call must each take a different part of it")
        if len({type(p) for p in parts}) != 1:
            raise FieldDeclarationError(f"{call}: parts are all indexes or all attribute names")


check(NVML_FIELDS)
