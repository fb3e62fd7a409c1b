"""A fake of the pynvml API surface Sentinel uses: the module's functions, constants and its
real error classes, with per-call behaviour the test controls (value, error, hang, delay)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pynvml


@dataclass(frozen=True)
class Handle:
    index: int


class FakePynvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: int = 2) -> None:
        self.n = gpus
        self.init_calls = 0
        self.shutdown_calls = 0
        # (function name, gpu index) -> value | NVMLError code (int wrapped in Err) | "hang"
        self.behaviour: dict[tuple[str, int], object] = {}
        self.release = threading.Event()
        self.xid_queue: list[tuple[int, int]] = []
        self.init_error: int | None = None
        # gpu index -> seconds every device call on that GPU takes (a slow but working GPU)
        self.delay: dict[int, float] = {}
        self.calls: Counter[int] = Counter()  # device calls started, per GPU index

    def __getattr__(self, name):
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type):
            raise AttributeError(name)
        return value

    def _do(self, fn: str, h, default):
        self.calls[h.index] += 1
        delay = self.delay.get(h.index, 0.0)
        if delay:
            time.sleep(delay)
        b = self.behaviour.get((fn, h.index), self.behaviour.get((fn, -1), default))
        if b == "hang":
            self.release.wait(30)
            return default
        if isinstance(b, Err):
            raise pynvml.NVMLError(b.code)
        return b

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

    def nvmlDeviceGetTotalEccErrors(self, h, err, counter):
        return self._do(f"ecc{err}{counter}", h, 0)

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return self._do(f"retired{cause}", h, [])

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._do("retired_pending", h, pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetRemappedRows(self, h):
        return self._do("remapped", h, (0, 0, 0, 0))

    def nvmlDeviceGetRowRemapperHistogram(self, h):
        return self._do("histogram", h, SimpleNamespace(max=640, high=0, partial=0, low=0, none=0))

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._do("pcie_replay", h, 0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._do("pcie_gen", h, 4)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._do("pcie_width", h, 16)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._do("temperature", h, 40)

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        return self._do("temp_threshold", h, 88)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._do("power", h, 250500)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._do("clocks_event_reasons", h, 0)

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
