"""The circuit breaker: Sentinel refuses to cordon one more node when that would put more than
``breaker_max_fraction`` of the job's / partition's nodes under a Sentinel cordon made in the
last ``breaker_window_seconds`` (defaults 0.5 and 300 s, as NVSentinel's). A fleet-wide
"failure" that is really a bad driver roll-out, a monitoring bug or a rack power event must not
drain the cluster. A refusal still tells the job to snapshot; it is logged, counted
(``sentinel_breaker_refusals_total``) and alerted (``SentinelCircuitBreakerOpen``).

Pure: the counts come from the backend (:meth:`Backend.fleet`), the time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from sentinel.backends.base import Fleet


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    recent: int  # Sentinel cordons in the window, this node excluded
    nodes: int
    why: str


def decide(fleet: Fleet | None, node: str, now: float, *, max_fraction: float, window_seconds: float) -> Verdict:
    """Allowed unless cordoning ``node`` would make more than ``max_fraction`` of ``fleet.nodes``
    Sentinel-cordoned within ``window_seconds``. No fleet view (file/command backends) or an
    empty one: allowed (there is nothing to count)."""
    if fleet is None or fleet.nodes <= 0:
        return Verdict(True, 0, 0, "no fleet view: the breaker does not apply")
    recent = {n for n, t in fleet.sentinel_cordons if n != node and now - window_seconds <= t <= now + 60}
    after = (len(recent) + 1) / fleet.nodes
    if after > max_fraction:
        return Verdict(False, len(recent), fleet.nodes,
                       f"{len(recent)} of {fleet.nodes} nodes were cordoned by Sentinel in the last "
                       f"{window_seconds:g} s; cordoning this one would make {after:.0%} > {max_fraction:.0%}")
    return Verdict(True, len(recent), fleet.nodes,
                   f"{len(recent)} of {fleet.nodes} nodes cordoned by Sentinel in the last {window_seconds:g} s; "
                   f"{after:.0%} <= {max_fraction:.0%}")
