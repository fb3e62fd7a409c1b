"""Fatal signals to the node's training ranks, seen in the kernel (``signal:signal_generate``)
the moment they are generated — not at torchrun's next monitor tick.

The watched pids come from ``ranks_provider`` when one is given (the control channel's verified
ranks), else from the names in the channel's ``ranks/`` directory (``<pid>.sock`` or
``<pid>.<hex token>.sock``; anyone may create files there, so at most ``max_ranks`` entries are
looked at and other names are ignored). The BPF map of watched pids holds ``max_ranks``; it is
kept in sync on every drain, and a pid that does not fit, or a map update the kernel refuses, is
counted, never raised.

Each event carries the signal's ``si_code``. For SIGBUS it tells a memory failure
(BUS_MCEERR_AR 4, BUS_MCEERR_AO 5) from any other SIGBUS (``kill -BUS`` is SI_USER 0, tkill
SI_TKILL -6, a truncated mmap BUS_ADRERR 2). The code alone proves nothing: any process may
send *itself* a SIGBUS with BUS_MCEERR_AR through ``rt_sigqueueinfo`` (the kernel only refuses
a si_code >= 0 sent to *another* process). So a memory-failure code is confirmed by the
kernel's own record (``memory_failure`` in the event's detail):

* ``"kernel"`` — the kernel stack at ``signal_generate`` passes through ``force_sig_mceerr`` or
  ``send_sig_mceerr``, the only kernel functions that build a memory-failure siginfo (from the
  page-fault or machine-check path, or from ``memory_failure()`` itself);
* ``"kernel_ras"`` — no such frame was seen, but the kernel reported a memory failure
  (``ras:memory_failure_event``, where the kernel has it) within :data:`RAS_WINDOW_NS` before;
* ``"forged"`` — the stack was read and shows neither (the ``rt_sigqueueinfo`` syscall, a
  SIGIO redirected with ``F_SETSIG``): a process made it up;
* ``"unconfirmed"`` — the stack could not be read and there is no other record.

Only the first two migrate (:mod:`sentinel.rules.rank_signal`). ``sentinel_kernel_events_total``
counts kind ``SIGBUS_memory_failure`` (confirmed), ``SIGBUS_memory_failure_unconfirmed``
(forged or unconfirmed: alerted, ``SentinelForgedMemoryFailureSignal``) and ``SIGBUS_not_memory``.

    python -m sentinel.sources.rank_signals -v --pid 1234
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterable

from sentinel.channel import parse_rank_name
from sentinel.readings import KernelEvent
from sentinel.sources.ebpf import RingProbe
from sentinel.families import Family, counter
from sentinel.sources.kernel import KERNEL_EVENTS, KernelSource, run_alone

log = logging.getLogger("sentinel.rank_signals")
SIGNALS = {7: "SIGBUS", 11: "SIGSEGV", 9: "SIGKILL", 6: "SIGABRT"}
BUS_MCEERR_AR = 4  # hardware memory error consumed on a machine check: action required
BUS_MCEERR_AO = 5  # hardware memory error detected in the process: action optional
MEMORY_FAILURE_CODES = frozenset({BUS_MCEERR_AR, BUS_MCEERR_AO})
# The kernel functions that send a memory-failure SIGBUS (kernel/signal.c); one of them is on the
# kernel stack of every genuine one.
MEMORY_FAILURE_SENDERS = frozenset({"force_sig_mceerr", "send_sig_mceerr"})
RAS_WINDOW_NS = 60 * 10**9  # a ras:memory_failure_event this recent corroborates a memory-failure code
PID_MAX_LIMIT = 1 << 22  # pid_max can be at most this; pids are below pid_max
_MAP_FULL = os.strerror(errno.E2BIG)  # what bcc's message carries when a hash map is full


def rank_pid(name: str) -> int | None:
    """The pid in a ``ranks/`` entry name, or None: the channel's own parser (one for both)."""
    pid = parse_rank_name(name)
    return pid if pid is not None and pid < PID_MAX_LIMIT else None


EBPF_MAP_ERRORS = counter("sentinel_ebpf_map_errors",
                          "Failures to keep an eBPF map in step with user space other than a full map, by probe and reason",
                          "probe", "reason")
EBPF_MAP_FULL = counter("sentinel_ebpf_map_full",
                        "Map syncs that could not watch every rank offered (more than the map holds), by probe", "probe")


class RankSignalSource(KernelSource):
    name = "rank_signals"
    FAMILIES = KernelSource.FAMILIES + (KERNEL_EVENTS, EBPF_MAP_ERRORS, EBPF_MAP_FULL)

    def __init__(self, ranks_dir: Path | None = None, *, max_ranks: int = 1024,
                 ranks_provider: Callable[[], Iterable[int]] | None = None, pids: Iterable[int] = ()) -> None:
        super().__init__()
        self.ranks_dir = ranks_dir
        self.max_ranks = max_ranks
        self.ranks_provider = ranks_provider
        self.probe: RingProbe | None = None
        self.watched: set[int] = set()
        self.extra: set[int] = set(pids)  # watched whatever the provider or directory says (--pid)
        self.ras = False  # ras:memory_failure_event attached
        self._symbols: dict[int, str] = {}

    def start(self) -> None:
        from sentinel.sources.ebpf import tracepoint_exists

        self.ras = tracepoint_exists("ras", "memory_failure_event")
        self.probe = self.load_probe("ebpf_rank_signals", RingProbe(
            "rank_signals", "rank_signals.bpf.c", ("signal", "signal_generate"),
            cflags={"MAX_RANKS": self.max_ranks, "RINGBUF_PAGES": 16, "HAVE_MF_EVENT": int(self.ras)},
            on_event=self._on_event))
        self.sync()

    def _count(self, family: Family, **labels: str) -> None:
        self.counts[family.key(probe="rank_signals", **labels)] += 1

    def symbol(self, address: int) -> str:
        """The kernel function at ``address`` (bcc's /proc/kallsyms lookup), cached; "" if unknown."""
        name = self._symbols.get(address)
        if name is None:
            try:
                from sentinel.sources.ebpf import import_bcc

                raw = import_bcc().BPF.ksym(address)
                name = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
            except Exception:  # noqa: BLE001 - an unknown address is simply not evidence
                name = ""
            if name.startswith("["):  # "[unknown]"
                name = ""
            if len(self._symbols) < 4096:
                self._symbols[address] = name
        return name

    def memory_failure_origin(self, e) -> str:
        """Who generated a memory-failure SIGBUS: "kernel", "kernel_ras", "forged" or
        "unconfirmed" (see the module docstring)."""
        n = int(e.kstack_bytes)
        frames = [self.symbol(int(e.kstack[i])) for i in range(min(n // 8, len(e.kstack)))] if n > 0 else []
        if any(f in MEMORY_FAILURE_SENDERS for f in frames):
            return "kernel"
        mf = int(e.memory_failure_ts_ns)
        if mf and 0 <= int(e.ts_ns) - mf <= RAS_WINDOW_NS:
            return "kernel_ras"
        return "forged" if frames else "unconfirmed"


    def _offered(self) -> tuple[list[int], bool] | None:
        """``(pids, more)``: the pids offered for watching, in order, at most ``max_ranks + 1`` of
        them, and whether more were there than were looked at. None when the provider failed or
        the directory could not be read: the watched pids then stay as they are. Never raises."""
        limit = self.max_ranks + 1
        if self.ranks_provider is not None:
            try:
                offered = list(itertools.islice(iter(self.ranks_provider()), limit))
            except Exception as exc:  # noqa: BLE001 - a failing provider must not stop the probe
                log.warning("the rank provider failed: %s", exc)
                self._count(EBPF_MAP_ERRORS, reason="provider")
                return None
            return [p for p in offered if isinstance(p, int) and 1 < p < PID_MAX_LIMIT], len(offered) >= limit
        if self.ranks_dir is None:
            return [], False
        pids: list[int] = []
        try:
            with os.scandir(self.ranks_dir) as entries:
                # at most max_ranks entries (of any name) are looked at, and one more to notice
                # that there were more: a directory anyone can write to bounds nothing by itself
                names = [entry.name for entry in itertools.islice(entries, limit)]
        except FileNotFoundError:
            return [], False
        except OSError as exc:
            log.warning("cannot list %s: %s", self.ranks_dir, exc)
            self._count(EBPF_MAP_ERRORS, reason="list")
            return None
        for name in names[:self.max_ranks]:
            pid = rank_pid(name)
            if pid is not None:
                pids.append(pid)
        return pids, len(names) >= limit

    def current_ranks(self) -> tuple[set[int], bool] | None:
        """``(pids, overflow)``: at most ``max_ranks`` pids to watch (``extra`` first), and whether
        some offered ones did not fit. None: keep what is watched."""
        offered = self._offered()
        if offered is None:
            return None
        pids, overflow = offered
        want: set[int] = set()
        for pid in itertools.chain(sorted(self.extra), pids):
            if pid in want:
                continue
            if len(want) >= self.max_ranks:
                overflow = True
                break
            want.add(pid)
        return want, overflow

    def sync(self) -> None:
        """Make the BPF map hold ``current_ranks()``. Never raises. ``sentinel_ebpf_map_full_total``
        counts the syncs that could not watch every rank offered (more than ``max_ranks`` offered
        or listed, or the kernel refused an update as the map was full);
        ``sentinel_ebpf_map_errors_total{reason}`` counts any other failure. What was refused is
        tried again at the next sync."""
        if self.probe is None:
            return
        try:
            current = self.current_ranks()
            if current is None:
                return
            want, overflow = current
            table = self.probe.table("ranks")
        except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception; the probe goes on
            log.warning("rank map sync failed: %s", exc)
            self._count(EBPF_MAP_ERRORS, reason="sync")
            return
        for pid in self.watched - want:
            try:
                del table[ctypes.c_uint32(pid)]
            except KeyError:  # bcc's answer to every failed delete; the entry is not there
                pass
            self.watched.discard(pid)
        for pid in sorted(want - self.watched):
            try:
                table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
            except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception("Could not update table: ...")
                if _MAP_FULL in str(exc):
                    overflow = True
                else:
                    log.warning("adding pid %d to the rank map failed: %s", pid, exc)
                    self._count(EBPF_MAP_ERRORS, reason="update")
                continue
            self.watched.add(pid)
        if overflow:
            self._count(EBPF_MAP_FULL)

    def _on_event(self, e) -> None:
        sig = SIGNALS.get(e.sig, str(e.sig))
        code = int(e.code)
        origin = ""
        if sig == "SIGBUS" and code in MEMORY_FAILURE_CODES:
            origin = self.memory_failure_origin(e)
            confirmed = origin in ("kernel", "kernel_ras")
            kind = "SIGBUS_memory_failure" if confirmed else "SIGBUS_memory_failure_unconfirmed"
            if not confirmed:
                log.error("SIGBUS with a memory-failure si_code %d for rank pid %d, sent by pid %d, has no kernel "
                          "record (%s): not acted on", code, e.pid, e.sender_pid, origin)
        elif sig == "SIGBUS":
            kind = "SIGBUS_not_memory"
        else:
            kind = sig
        self.counts[KERNEL_EVENTS.key(source="ebpf_rank_signals", kind=kind)] += 1
        detail = {"pid": e.pid, "signal": sig, "code": code, "sender_pid": e.sender_pid,
                  "comm": bytes(e.comm).split(b"\0", 1)[0].decode("utf-8", "replace"), "ts_ns": e.ts_ns}
        if origin:
            detail["memory_failure"] = origin
        self.push(event=KernelEvent(kind="rank_signal", source="ebpf_rank_signals", detail=detail))

    def drain(self):
        """Sync the watched pids, then hand over the events. Never raises."""
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - sync already counts its failures; this is the backstop
            log.exception("rank map sync failed")
            self._count(EBPF_MAP_ERRORS, reason="sync")
        return super().drain()


def main(argv: list[str] | None = None) -> int:
    def make(a):
        return RankSignalSource(a.ranks_dir, pids=a.pid)

    def add(ap):
        ap.add_argument("--pid", type=int, action="append", default=[], help="watch this pid (repeatable)")
        ap.add_argument("--ranks-dir", type=Path, help="watch the ranks of this runtime directory")

    return run_alone("python -m sentinel.sources.rank_signals", make,
                     lambda e: (f"{e.detail['signal']} (si_code {e.detail['code']}) -> pid {e.detail['pid']} "
                                f"({e.detail['comm']}) from pid {e.detail['sender_pid']}"
                                + (f", memory failure: {e.detail['memory_failure']}" if "memory_failure" in e.detail else "")),
                     add, argv)


if __name__ == "__main__":
    sys.exit(main())
