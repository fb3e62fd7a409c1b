"""``corrected_rate``: corrected hardware errors are a rate for the predictor, never a drain.

A corrected PCIe AER error (kernel log or the ``ras:aer_event`` tracepoint), an EDAC CE or a
corrected ``ras:mc_event``, a corrected APEI/GHES event, a corrected machine check: each is
counted per kind and device over ``corrected_rate_window_seconds``. When the rate reaches
``corrected_rate_watch_per_hour`` the GPU the errors name goes to WATCH (the predictor's
pre-failure state) and one ``alert`` carries the rate; nothing here ever snapshots or migrates.
The lines that only introduce or detail a report (the GHES header, EDAC's ``HANDLING MCE MEMORY
ERROR``, AER's ``error status/mask``) are claimed and not counted: the report's own line is.
A burst of them is a rate, not a thousand alerts.

Source: a rising corrected-error rate precedes uncorrected ones (the kernel's EDAC documentation:
"Detecting CE events ... CAN be a predictor of future UE events"); the threshold's default is
mcelog's per-DIMM trigger scaled to an hour (``memory-ce-threshold = 10 / 24h``, tightened).
"""

from __future__ import annotations

from sentinel.rules.base import ConfigKey, Finding, NodeRule

COUNTED = frozenset({"pcie_aer_corrected", "host_memory_ce", "hardware_error_corrected", "machine_check_corrected"})
CLAIMED = frozenset({"pcie_aer_detail", "host_memory_error_reported", "hardware_error_reported"})
BUCKETS = 60  # the window's history: (bucket start, count) pairs

CORRECTED_RATE_WINDOW_SECONDS = ConfigKey(
    "corrected_rate_window_seconds", 3600.0, "Sentinel: an hour, in 60 buckets", 60.0, 7 * 86400.0)
CORRECTED_RATE_WATCH_PER_HOUR = ConfigKey(
    "corrected_rate_watch_per_hour", 10.0, "mcelog memory-ce-threshold 10 per 24 h, applied per hour", 0.0, 1e9,
    low_open=True)


def counted(event) -> str | None:
    """The kind an event counts as, ``""`` for one claimed but not counted, None if not ours."""
    d = event.detail
    if event.kind == "kernel_log":
        kind = str(d.get("kind"))
        return kind if kind in COUNTED else "" if kind in CLAIMED else None
    if event.kind == "aer" and d.get("severity") == "corrected":
        return "pcie_aer_corrected"
    if event.kind == "mc_error" and d.get("type") == "corrected":
        return "host_memory_ce"
    return None


def advance(history: tuple[tuple[float, int], ...], now: float, n: int, window: float) -> tuple[tuple[float, int], ...]:
    """``history`` with ``n`` events at ``now`` added and what fell out of ``window`` dropped."""
    width = window / BUCKETS
    kept = tuple(b for b in history if now - b[0] < window)
    if kept and now - kept[-1][0] < width:
        return kept[:-1] + ((kept[-1][0], kept[-1][1] + n),)
    return (kept + ((now, n),))[-BUCKETS:]


class CorrectedRate(NodeRule):
    """Corrected errors of one kind on one device over the window reach the watch rate → GPU in
    WATCH and one ``alert`` (its cause cooled down: a burst is one alert); never a snapshot or a drain.

    Source: the kernel's EDAC documentation (CE rates predict UEs); mcelog's CE threshold."""

    name = "corrected_rate"
    order = 605
    rated = True
    config = (CORRECTED_RATE_WINDOW_SECONDS, CORRECTED_RATE_WATCH_PER_HOUR)

    def rate_key(self, event) -> str | None:
        kind = counted(event)
        if kind is None:
            return None
        where = event.gpu if event.gpu is not None else str(event.detail.get("device") or "node")
        return f"{self.name}:{kind}:{where}" if kind else ""

    def evaluate_rate(self, event, cfg, history, now):
        """(a Finding or None, the new history) for one claimed event."""
        kind = counted(event)
        if not kind:
            return None, history
        n = event.detail.get("count") if isinstance(event.detail.get("count"), int) else 1
        history = advance(history, now, max(1, min(int(n), 1_000_000)), cfg.corrected_rate_window_seconds)
        total = sum(c for _, c in history)
        per_hour = total * 3600.0 / cfg.corrected_rate_window_seconds
        if per_hour < cfg.corrected_rate_watch_per_hour:
            return None, history
        where = f"GPU {event.gpu}" if event.gpu is not None else str(event.detail.get("device") or "node")
        return Finding("alert", self.rate_key(event),
                       f"{total} {kind.replace('_', ' ')} error(s) in {cfg.corrected_rate_window_seconds:g} s on {where} "
                       f"({per_hour:.0f}/h >= {cfg.corrected_rate_watch_per_hour:g}/h): watch, no drain",
                       {"count": float(total), "rate_per_hour": per_hour}), history

    def evaluate(self, event, cfg):  # the policy calls evaluate_rate; a stateless call sees no rate
        return None


RULE = CorrectedRate()
