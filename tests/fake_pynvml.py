"""A fake of the pynvml API surface Sentinel uses: the module's functions, constants and its
real error classes, with per-call behaviour the test controls (value, error, hang, delay).

The functions that read NVML fields are not written out here: every pynvml call declared in
sentinel/fields.py is served from the declarations, so a new field needs nothing in this file.
Its behaviour key is the field's name and a value is given in the reading's units
(``behaviour[("power_watts", 0)] = 250.5``), which the field's codec turns into what pynvml
returns. An error or "hang" on one field of a shared call (``remapped_rows_pending``) is the
whole call's.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pynvml

from sentinel import fields as nvml_fields

# Where the fake's healthy A100 differs from the simulator's H100 (the declared sim_default).
FAKE_DEFAULTS: dict[str, float] = {"pcie_link_gen": 4, "temperature_celsius": 40, "slowdown_temperature_celsius": 88,
                                   "power_watts": 250.5}


@dataclass(frozen=True)
class Handle:
    index: int


class FakePynvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: int = 2) -> None:
        self.n = gpus
        self.init_calls = 0
        self.shutdown_calls = 0
        # (field name, or key of another call: uuid, name, serial, pci_info, nvlink_state, nvlink<counter>;
        #  gpu index, -1 for every GPU) -> value | NVMLError code (int wrapped in Err) | "hang"
        self.behaviour: dict[tuple[str, int], object] = {}
        self.release = threading.Event()
        self.xid_queue: list[tuple[int, int]] = []
        self.init_error: int | None = None
        # gpu index -> seconds every device call on that GPU takes (a slow but working GPU)
        self.delay: dict[int, float] = {}
        self.calls: Counter[int] = Counter()  # device calls started, per GPU index
        self.field_value_calls = 0  # nvmlDeviceGetFieldValues calls (each also counted in calls)
        self.fields = nvml_fields.NVML_FIELDS
        self._field_calls = nvml_fields.calls(self.fields)

    def __getattr__(self, name):
        if name in self.__dict__.get("_field_calls", ()):
            return functools.partial(self._field_call, name)
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type):
            raise AttributeError(name)
        return value

    def _do(self, fn: str, h, default):
        return self._respond(h, self.behaviour.get((fn, h.index), self.behaviour.get((fn, -1), default)), default)

    def _respond(self, h, b, default):
        self.calls[h.index] += 1
        delay = self.delay.get(h.index, 0.0)
        if delay:
            time.sleep(delay)
        if b == "hang":
            self.release.wait(30)
            return default
        if isinstance(b, Err):
            raise pynvml.NVMLError(b.code)
        return b

    def _field_call(self, call: str, h, *args):
        """A declared pynvml field call: what the behaviour of its field(s) makes it return."""
        chosen = {}

        def value(f):
            b = self.behaviour.get((f.name, h.index), self.behaviour.get((f.name, -1)))
            chosen[f.name] = b
            return FAKE_DEFAULTS.get(f.name, f.sim_default) if b is None or b == "hang" or isinstance(b, Err) else b

        group, build = nvml_fields.serve(self.fields, pynvml, call, args, value)
        if not group:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        result = build()
        outcomes = list(chosen.values())
        outcome = "hang" if "hang" in outcomes else next((b for b in outcomes if isinstance(b, Err)), result)
        return self._respond(h, outcome, result)

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return Handle(i)

    def nvmlDeviceGetUUID(self, h):
        return self._do("uuid", h, f"GPU-fake-{h.index}")

    def nvmlDeviceGetName(self, h):
        return self._do("name", h, b"NVIDIA A100-SXM4-80GB")

    def nvmlDeviceGetSerial(self, h):
        return self._do("serial", h, f"14240000{h.index}")

    def nvmlDeviceGetPciInfo(self, h):
        return self._do("pci_info", h, SimpleNamespace(busId=f"00000000:{0x07 + h.index:02X}:00.0".encode()))

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        """One device call for every requested field id (counted once); each entry answers with its
        field's behaviour: a value, Err(code) for that entry, or "hang" (the whole call hangs)."""
        outcomes = []

        def scalar(f):
            b = self.behaviour.get((f.name, h.index), self.behaviour.get((f.name, -1)))
            outcomes.append(b)
            if isinstance(b, Err):
                return b.code, 0
            return pynvml.NVML_SUCCESS, FAKE_DEFAULTS.get(f.name, f.sim_default) if b is None or b == "hang" else b

        def nvlink(link, kind):
            key = f"nvlink{getattr(pynvml, 'NVML_NVLINK_ERROR_DL_' + kind.upper())}"
            b = self.behaviour.get((key, h.index), self.behaviour.get((key, -1)))
            outcomes.append(b)
            if isinstance(b, Err):
                return b.code, 0
            return pynvml.NVML_SUCCESS, 0 if b is None or b == "hang" else b

        result = nvml_fields.serve_field_values(self.fields, pynvml, field_ids, scalar, nvlink, self._links(h))
        self.field_value_calls += 1
        return self._respond(h, "hang" if "hang" in outcomes else result, result)

    def _links(self, h) -> list[int]:
        """The GPU's enabled links, as nvmlDeviceGetNvLinkState answers them (not counted as calls)."""
        b = self.behaviour.get(("nvlink_state", h.index), self.behaviour.get(("nvlink_state", -1)))
        if b is None:
            return [0, 1]
        return [link for link in range(pynvml.NVML_NVLINK_MAX_LINKS) if b == pynvml.NVML_FEATURE_ENABLED]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return self._do("nvlink_state", h, pynvml.NVML_FEATURE_ENABLED if link < 2 else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return self._do(f"nvlink{counter}", h, 0)

    def nvmlEventSetCreate(self):
        return SimpleNamespace()

    def nvmlDeviceRegisterEvents(self, h, types, es):
        return None

    def nvmlEventSetWait_v2(self, es, timeout_ms):
        if self.xid_queue:
            gpu, xid = self.xid_queue.pop(0)
            return SimpleNamespace(device=Handle(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)
        threading.Event().wait(timeout_ms / 1000)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, es):
        return None


class Err:
    def __init__(self, code: int) -> None:
        self.code = code
