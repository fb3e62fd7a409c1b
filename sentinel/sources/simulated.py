"""Simulated NVML: the pynvml API backed by a JSON state file describing N GPUs.

:class:`SimulatedNvml` implements the pynvml functions :mod:`sentinel.sources.nvml` calls, with
pynvml's own error classes and constants, so tests, demos and drills run the daemon's real NVML
code path (deadlines, slow calls, "not supported", GPU lost) without a GPU. Other processes change the state
file to inject faults (``sentinel inject``); every write is atomic (write + rename, under an
advisory lock so concurrent injectors never lose each other's changes). A corrupt or
half-written file is a :class:`SimulatedStateError` with a clear message; while the daemon runs
it surfaces as an NVML error reading, never a crash.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import json
import math
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pynvml

from sentinel import fields as nvml_fields
from sentinel.fsutil import write_atomic

STATE_VERSION = 1
# CPU one real NVML call costs the calling thread: 0.09 ms for four pynvml reads (temperature,
# utilisation, memory, power) of one GPU, measured against 13.6 ms for nvidia-smi
# (github.com/davidboulay/OpenKraken pull 3, RTX 5080, 2026): 22.5 us a call. Each simulated call
# spends this much on top of its own work, so a profile of the daemon over the simulated backend
# splits like one over a driver (bench/poll_overhead.py); a parameter of SimulatedNvml.
NVML_CALL_SECONDS = 0.09e-3 / 4
NVLINK_LINKS = 18
# Bus ids of an 8-GPU HGX board; further GPUs continue the pattern.
_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


class SimulatedStateError(ValueError):
    """The state file is missing, corrupt, half-written or of the wrong shape."""


def _base_state(index: int) -> dict[str, Any]:
    """A healthy GPU's state apart from its NVML fields (those come from sentinel/fields.py)."""
    bus = _BUSES[index] if index < len(_BUSES) else f"{0x10 + index:02x}"
    return {
        "index": index,
        "uuid": f"GPU-5e0a1c2d-0000-4000-8000-{index:012x}",
        "pci_bus_id": f"00000000:{bus.upper()}:00.0",
        "name": "NVIDIA H100 80GB HBM3 (simulated)",
        "serial": f"SIM{index:010d}",
        # NVML reads a data-CRC counter on the 12 links NVLink 3 has (NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_L0..L11);
        # links 12-17 exist only on NVLink 4, which reports replay, recovery and one CRC counter
        "nvlink": [{"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0} if link < 12 else
                   {"crc_flit": 0, "replay": 0, "recovery": 0} for link in range(NVLINK_LINKS)],
        "xid_events": [],
        "lost": False,
        "hang": False,
        "slow_seconds": 0.0,
        "unsupported": [],
    }


def _declared_fields() -> tuple[nvml_fields.NvmlField, ...]:
    """The NVML field declarations, checked against the keys the simulator keeps for itself."""
    declared = nvml_fields.NVML_FIELDS
    clash = {f.name for f in declared if f.state_path[0] in _base_state(0)}
    if clash:
        raise nvml_fields.FieldDeclarationError(f"simulated state path of {', '.join(sorted(clash))} is a key the simulator keeps")
    return declared


def _stored(gpu: dict[str, Any], f: nvml_fields.NvmlField) -> Any:
    """A field's value in a GPU's state; its declared healthy value when the state lacks it."""
    node: Any = gpu
    for key in f.state_path:
        if not isinstance(node, dict) or key not in node:
            return f.sim_default
        node = node[key]
    return node


def _store_default(gpu: dict[str, Any], f: nvml_fields.NvmlField) -> None:
    node = gpu
    for key in f.state_path[:-1]:
        node = node.setdefault(key, {})
    node.setdefault(f.state_path[-1], f.sim_default)


def gpu_state(index: int) -> dict[str, Any]:
    gpu = _base_state(index)
    for f in _declared_fields():
        _store_default(gpu, f)
    return gpu


# Keys a state file written before they existed may lack; parse_state fills in these defaults
# (and the declared default of every NVML field the file lacks).
_OPTIONAL_GPU_KEYS: dict[str, Any] = {"slow_seconds": 0.0}
_SLOW_MAX_SECONDS = 60.0


def healthy_state(gpus: int, driver_version: str = "550.90.07-sim") -> dict[str, Any]:
    if gpus < 1:
        raise SimulatedStateError("--gpus must be at least 1")
    return {"version": STATE_VERSION, "driver_version": driver_version, "gpus": [gpu_state(i) for i in range(gpus)]}


def parse_state(text: str, where: str) -> dict[str, Any]:
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimulatedStateError(
            f"{where}: corrupt or half-written simulated GPU state ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            f"recreate it with `sentinel simulate init {where}`"
        ) from None
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or not isinstance(state.get("gpus"), list):
        raise SimulatedStateError(f"{where}: not a version-{STATE_VERSION} simulated GPU state (missing 'version' or 'gpus')")
    declared = _declared_fields()
    for i, gpu in enumerate(state["gpus"]):
        missing = set(_base_state(i)) - set(gpu) - set(_OPTIONAL_GPU_KEYS) if isinstance(gpu, dict) else {"everything"}
        if missing:
            raise SimulatedStateError(f"{where}: gpus[{i}] is missing {', '.join(sorted(missing))}")
        for key, default in _OPTIONAL_GPU_KEYS.items():
            gpu.setdefault(key, default)
        for f in declared:  # a field declared after the file was written reads its healthy value
            try:
                _store_default(gpu, f)
            except AttributeError:
                raise SimulatedStateError(f"{where}: gpus[{i}].{'.'.join(f.state_path[:-1])} is not an object") from None
    return state


def load_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SimulatedStateError(f"{path}: no such state file; create it with `sentinel simulate init {path}`") from None
    except OSError as exc:
        raise SimulatedStateError(f"{path}: cannot read state file: {exc.strerror}") from None
    return parse_state(text, str(path))


def write_state(path: str | Path, state: dict[str, Any]) -> None:
    """Atomic, through the project's one writer (:func:`sentinel.fsutil.write_atomic`)."""
    write_atomic(Path(path), json.dumps(state, indent=1), mode=0o644)


@contextmanager
def locked_state(path: str | Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write under an advisory lock; the new state is written atomically on exit."""
    path = Path(path)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state(path)
        yield state
        write_state(path, state)


FAULTS = {
    "ecc-sbe": "add N corrected ECC errors (volatile and aggregate)",
    "ecc-dbe": "add N uncorrected ECC errors (volatile and aggregate)",
    "retired-sbe": "retire N pages for multiple single-bit errors",
    "retired-dbe": "retire N pages for double-bit errors",
    "retired-pending": "mark a page retirement pending",
    "remap-correctable": "add N rows remapped for correctable errors",
    "remap-uncorrectable": "add N rows remapped for uncorrectable errors",
    "remap-pending": "mark a row remap pending",
    "remap-failure": "mark a row remap failure",
    "remap-histogram": "set bank availability: max|high|partial|low|none",
    "pcie-replay": "add N PCIe replays",
    "nvlink-crc": "add N NVLink CRC flit errors on link 0 (or =+N@LINK)",
    "xid": "report Xid NN through the NVML event set",
    "lost": "the GPU falls off the bus (GPU_IS_LOST on every call)",
    "hang": "the next NVML call on this GPU blocks until `unhang`",
    "unhang": "release a hang",
    "slow": "every NVML call on this GPU takes SECONDS longer but works (=0 to clear), e.g. slow=0.25",
    "temp": "set the temperature to C degrees",
    "reset": "driver reload / GPU reset: volatile counters back to 0, lost and hang cleared",
    "unsupported": "make FIELD report NVML_ERROR_NOT_SUPPORTED (takes effect at daemon start)",
    "set": "set any declared NVML field to a number (or true/false), e.g. set=power_watts:700",
}

_FAULT_RE = re.compile(r"^(?P<name>[a-z-]+)(?:=(?P<value>.+))?$")


def _plus(fault: str, value: str | None) -> int:
    if value is None or not re.fullmatch(r"\+?\d+", value):
        raise SimulatedStateError(f"{fault}: expects =+N (a non-negative count), e.g. {fault}=+1")
    return int(value.lstrip("+"))


def apply_fault(gpu: dict[str, Any], fault: str) -> None:
    m = _FAULT_RE.match(fault.strip())
    if not m or m.group("name") not in FAULTS:
        raise SimulatedStateError(f"unknown fault {fault!r}; known: {', '.join(sorted(FAULTS))}")
    name, value = m.group("name"), m.group("value")
    ecc = gpu["ecc"]
    if name in ("ecc-sbe", "ecc-dbe"):
        n, kind = _plus(name, value), "corrected" if name == "ecc-sbe" else "uncorrected"
        ecc[f"{kind}_volatile"] += n
        ecc[f"{kind}_aggregate"] += n
    elif name in ("retired-sbe", "retired-dbe"):
        gpu["retired_pages"][name.split("-")[1]] += _plus(name, value)
    elif name == "retired-pending":
        gpu["retired_pages"]["pending"] = True
    elif name in ("remap-correctable", "remap-uncorrectable"):
        gpu["remapped_rows"][name.split("-")[1]] += _plus(name, value)
    elif name == "remap-pending":
        gpu["remapped_rows"]["pending"] = True
    elif name == "remap-failure":
        gpu["remapped_rows"]["failure"] = True
    elif name == "remap-histogram":
        if value not in ("max", "high", "partial", "low", "none"):
            raise SimulatedStateError("remap-histogram: expects =max|high|partial|low|none")
        gpu["remap_histogram"] = {k: (8 if k == value else 0) for k in ("max", "high", "partial", "low", "none")}
    elif name == "pcie-replay":
        gpu["pcie"]["replay"] += _plus(name, value)
    elif name == "nvlink-crc":
        count, _, link = (value or "").partition("@")
        link_i = int(link) if link.isdigit() else 0
        if not 0 <= link_i < len(gpu["nvlink"]):
            raise SimulatedStateError(f"nvlink-crc: link {link_i} out of range")
        gpu["nvlink"][link_i]["crc_flit"] += _plus(name, count or None)
    elif name == "xid":
        if value is None or not value.isdigit():
            raise SimulatedStateError("xid: expects =NN, e.g. xid=79")
        gpu["xid_events"].append(int(value))
    elif name in ("lost", "hang"):
        gpu[name] = True
    elif name == "unhang":
        gpu["hang"] = False
    elif name == "slow":
        try:
            seconds = float(value or "")
        except ValueError:
            seconds = -1.0
        if not 0.0 <= seconds <= _SLOW_MAX_SECONDS:  # also rejects nan
            raise SimulatedStateError(f"slow: expects =SECONDS between 0 and {_SLOW_MAX_SECONDS:g}, e.g. slow=0.25")
        gpu["slow_seconds"] = seconds
    elif name == "temp":
        try:
            gpu["temperature_celsius"] = int(value or "")
        except ValueError:
            raise SimulatedStateError("temp: expects =C, e.g. temp=95") from None
    elif name == "reset":
        for key in ("corrected_volatile", "uncorrected_volatile"):
            ecc[key] = 0
        gpu["lost"] = gpu["hang"] = False
    elif name == "unsupported":
        gpu["unsupported"].append(value or "")
    elif name == "set":
        _set_field(gpu, value or "")


def _set_field(gpu: dict[str, Any], value: str) -> None:
    fname, _, text = value.partition(":")
    declared = {f.name: f for f in _declared_fields()}
    usage = "set: expects =FIELD:VALUE for a declared NVML field, e.g. set=power_watts:700"
    if fname not in declared:
        raise SimulatedStateError(f"{usage}; fields: {', '.join(declared)}")
    number: float | int | bool
    if text in ("true", "false"):
        number = text == "true"
    elif re.fullmatch(r"-?\d+", text):
        number = int(text)
    else:
        try:
            number = float(text)
        except ValueError:
            raise SimulatedStateError(usage) from None
        if not math.isfinite(number):
            raise SimulatedStateError(usage)
    path = declared[fname].state_path
    node = gpu
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = number


def inject(path: str | Path, gpu_index: int, faults: list[str]) -> dict[str, Any]:
    with locked_state(path) as state:
        if not 0 <= gpu_index < len(state["gpus"]):
            raise SimulatedStateError(f"--gpu {gpu_index}: the state has GPUs 0..{len(state['gpus']) - 1}")
        for fault in faults:
            apply_fault(state["gpus"][gpu_index], fault)
        return copy.deepcopy(state["gpus"][gpu_index])


# ---------------------------------------------------------------------------------------------
# The pynvml-compatible backend
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass
class _PciInfo:
    busId: str


@dataclass
class _EventData:
    device: _Handle
    eventType: int
    eventData: int


class _EventSet:
    def __init__(self, delivered: dict[int, int]) -> None:
        self.delivered = delivered
        self.devices: set[int] = set()


_BURN_RATE: list[float] = []  # bytes sha256 hashes per CPU second on this machine (measured once)


def _burn_buffer(seconds: float) -> bytes:
    """A buffer whose sha256 takes about ``seconds`` of CPU (hashlib drops the GIL past 2 KiB)."""
    if seconds <= 0:
        return b""
    if not _BURN_RATE:
        block = bytes(1 << 16)
        best = math.inf
        for _ in range(5):
            t = time.thread_time()
            hashlib.sha256(block)
            best = min(best, time.thread_time() - t)
        _BURN_RATE.append(len(block) / max(best, 1e-7))
    return bytes(max(2048, int(_BURN_RATE[0] * seconds)))


class SimulatedNvml:
    """A pynvml look-alike over a state file. Constants and error classes are pynvml's own.

    The functions that read NVML fields are not written out here: each declared field's pynvml
    call (see :mod:`sentinel.fields`, resolved when this is built) is served from the value at
    the field's state path. A call several fields share (one composite result) is "not
    supported" when any of them is listed in the GPU's ``unsupported``.
    """

    NVMLError = pynvml.NVMLError

    def __init__(self, state_path: str | Path, *, hang_poll_seconds: float = 0.05, hang_max_seconds: float = 3600.0,
                 recheck_seconds: float = 0.01, event_poll_seconds: float = 0.1,
                 call_cost_seconds: float = NVML_CALL_SECONDS):
        self.path = Path(state_path)
        self.call_cost = call_cost_seconds
        self._burn = _burn_buffer(call_cost_seconds)
        self._hang_poll = hang_poll_seconds
        self._hang_max = hang_max_seconds
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._state: dict[str, Any] | None = None
        self._initialized = False
        self._checked_at = -1.0
        # A changed file is noticed within recheck_seconds (one stat per window, not one per call).
        self._recheck = recheck_seconds
        self._event_poll = event_poll_seconds
        self._fields = _declared_fields()
        self._fv_cache: dict[int, tuple[dict[str, Any], dict[tuple, list]]] = {}  # GPU -> (its state, results)
        self._field_calls = nvml_fields.calls(self._fields)

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_field_calls", ()):
            value = functools.partial(self._serve_field_call, name)
        else:
            value = getattr(pynvml, name)  # AttributeError for unknown names, as pynvml would
            if callable(value) and not isinstance(value, type):
                raise AttributeError(f"SimulatedNvml does not implement {name}")
        # kept, as a module's attribute is: the next look-up of a constant is a dict look-up
        self.__dict__[name] = value
        return value

    # -- state --------------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """The current state; raises SimulatedStateError when the file is bad."""
        state = self._state
        if state is not None and time.monotonic() - self._checked_at < self._recheck:
            return state  # fast path, no lock: reading two attributes is atomic under the GIL
        with self._lock:
            now = time.monotonic()
            if self._state is not None and now - self._checked_at < self._recheck:
                return self._state
            self._checked_at = now
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                raise SimulatedStateError(f"{self.path}: no such state file; create it with `sentinel simulate init {self.path}`") from None
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._stamp or self._state is None:
                self._state = load_state(self.path)
                self._stamp = stamp
            return self._state

    def _loaded(self) -> dict[str, Any]:
        """The current state for an NVML call: a bad file is an NVML error, as a driver's would be."""
        try:
            return self.load()
        except SimulatedStateError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN) from None

    def _spend(self) -> None:
        """What a driver call costs the calling thread in CPU (``call_cost_seconds``), without the
        GIL, as a pynvml call (ctypes) spends it: hashing a buffer sized to take that long."""
        if self._burn:
            hashlib.sha256(self._burn)

    def _gpu(self, handle: _Handle) -> dict[str, Any]:
        self._spend()
        if not self._initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        try:
            gpu = self.load()["gpus"][handle.index]
        except SimulatedStateError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN) from None
        if gpu["hang"]:
            gpu = self._wait_unhang(handle)
        if gpu["slow_seconds"] > 0:
            time.sleep(gpu["slow_seconds"])
        if gpu["lost"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _wait_unhang(self, handle: _Handle) -> dict[str, Any]:
        end = time.monotonic() + self._hang_max
        while time.monotonic() < end:
            time.sleep(self._hang_poll)
            try:
                gpu = self.load()["gpus"][handle.index]
            except SimulatedStateError:
                continue
            if not gpu["hang"]:
                return gpu
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def _field(self, handle: _Handle, name: str) -> dict[str, Any]:
        gpu = self._gpu(handle)
        if name in gpu["unsupported"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -- pynvml API ---------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        try:
            self.load()
        except SimulatedStateError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED) from None
        self._initialized = True

    def nvmlShutdown(self) -> None:
        self._initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._loaded()["driver_version"])

    def nvmlDeviceGetCount(self) -> int:
        return len(self._loaded()["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self._loaded()["gpus"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        handle = _Handle(index)
        self._gpu(handle)
        return handle

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        return self._gpu(h)["uuid"]

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        return self._gpu(h)["name"]

    def nvmlDeviceGetSerial(self, h: _Handle) -> str:
        return self._field(h, "serial")["serial"]

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> _PciInfo:
        return _PciInfo(self._gpu(h)["pci_bus_id"])

    def _serve_field_call(self, call: str, h: _Handle, *args: Any) -> Any:
        gpu = self._gpu(h)
        group, build = nvml_fields.serve(self._fields, pynvml, call, args, lambda f: _stored(gpu, f))
        if not group:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if any(f.name in gpu["unsupported"] for f in group):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return build()

    def nvmlDeviceGetFieldValues(self, h: _Handle, field_ids: list) -> list:
        """Every declared field id and the NVLink counters (and their totals), from the state (one
        call: one stat), as pynvml returns them: a ctypes array of ``c_nvmlFieldValue_t``, which
        the daemon reads entry by entry at ctypes' cost, as it reads a driver's. Built once per
        state version and request (the simulation's own work, beside the call's
        ``call_cost_seconds``, stays a few microseconds: the backend costs what a driver's does)."""
        gpu = self._gpu(h)
        key = tuple(field_ids)
        built_from, cache = self._fv_cache.get(h.index, (None, {}))
        if built_from is not gpu:  # the state file changed: build again (each GPU's worker its own entry)
            cache = {}
            self._fv_cache[h.index] = (gpu, cache)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = self._field_values(gpu, field_ids)
        return hit

    def _field_values(self, gpu: dict[str, Any], field_ids: list) -> list:

        def scalar(f):
            return (pynvml.NVML_ERROR_NOT_SUPPORTED, 0) if f.name in gpu["unsupported"] else (pynvml.NVML_SUCCESS, _stored(gpu, f))

        def nvlink(link, kind):
            links = gpu["nvlink"]
            if "nvlink" in gpu["unsupported"] or link >= len(links) or kind not in links[link]:
                return pynvml.NVML_ERROR_NOT_SUPPORTED, 0
            return pynvml.NVML_SUCCESS, int(links[link][kind])

        return nvml_fields.serve_field_values(self._fields, pynvml, field_ids, scalar, nvlink, range(len(gpu["nvlink"])))

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        links = self._field(h, "nvlink")["nvlink"]
        if link >= len(links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: _Handle, link: int, counter: int) -> int:
        kind = {
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
            pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
            pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
        }[counter]
        counters = self._field(h, "nvlink")["nvlink"][link]
        if kind not in counters:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(counters[kind])

    def nvmlEventSetCreate(self) -> _EventSet:
        gpus = self._loaded()["gpus"]
        return _EventSet({i: len(g["xid_events"]) for i, g in enumerate(gpus)})

    def nvmlDeviceRegisterEvents(self, h: _Handle, event_types: int, event_set: _EventSet) -> None:
        self._gpu(h)
        event_set.devices.add(h.index)

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        end = time.monotonic() + timeout_ms / 1000.0
        while True:
            try:
                gpus = self.load()["gpus"]
            except SimulatedStateError:
                gpus = []
            for index in sorted(event_set.devices):
                events = gpus[index]["xid_events"] if index < len(gpus) else []
                seen = event_set.delivered.get(index, 0)
                if len(events) > seen:
                    self._spend()
                    event_set.delivered[index] = seen + 1
                    return _EventData(_Handle(index), pynvml.nvmlEventTypeXidCriticalError, int(events[seen]))
                if len(events) < seen:  # state re-initialised
                    event_set.delivered[index] = len(events)
            if time.monotonic() >= end:
                self._spend()
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            time.sleep(min(self._event_poll, max(0.0, end - time.monotonic())))

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        return None


class CountingNvml:
    """Counts the device calls a source makes through a pynvml look-alike (the poll benchmark and
    the batching tests measure NVML calls per GPU per poll with it)."""

    def __init__(self, nvml) -> None:
        self._nvml = nvml
        self.calls = 0

    def __getattr__(self, name):
        value = getattr(self._nvml, name)
        if callable(value) and name.startswith("nvmlDevice") and not isinstance(value, type):
            def counted(*args, **kw):
                self.calls += 1
                return value(*args, **kw)
            return counted
        return value

