"""The circuit breaker: Sentinel refuses to cordon one more node when that would put more than
``breaker_max_fraction`` of the job's / partition's nodes under a Sentinel cordon made in the
last ``breaker_window_seconds`` (defaults 0.5 and 300 s, as NVSentinel's). A fleet-wide
"failure" that is really a bad driver roll-out, a monitoring bug or a rack power event must not
drain the cluster. A refusal still tells the job to snapshot; it is logged, counted
(``sentinel_breaker_refusals_total``) and alerted (``SentinelCircuitBreakerOpen``).

Pure: the counts come from the backend (:meth:`Backend.fleet`), the time is passed in.
"""

from __future__ import annotations

import math

from sentinel.backends.base import Fleet, Verdict

__all__ = ["Verdict", "decide", "in_window", "slots", "settle"]


def in_window(t: float, now: float, window_seconds: float) -> bool:
    """Whether a Sentinel cordon stamped ``t`` counts as recent at ``now``. A stamp ahead of this
    node's clock counts, however far: it comes from another clock (slurmctld's, another node's),
    and leaving it out would let a clock skew open the breaker under a burst (fail-safe: refuse)."""
    return t >= now - window_seconds


def slots(nodes: int, max_fraction: float) -> int:
    """How many of ``nodes`` may be under a recent Sentinel cordon at once."""
    return int(math.floor(max_fraction * nodes + 1e-9))


def settle(fleet: Fleet, node: str, now: float, *, max_fraction: float, window_seconds: float) -> tuple[str, Verdict]:
    """Drain-then-recount (Slurm): called after this node's own Sentinel cordon is in place, on a
    fresh count. ``"won"`` when the recent Sentinel cordons, this one included, fit in
    :func:`slots`; ``"lost"`` when this node ranks past the slots in the deterministic order
    (cordon time, then node name: every node computes the same order from the same count) and
    must undo its cordon; ``"wait"`` when it ranks within the slots but nodes ranked after it
    have not undone theirs yet (count again shortly; a node that never gets to ``"won"`` before
    its deadline undoes its cordon too).

    Why it holds under a burst: a node keeps its cordon only on a count that is within the
    slots, and it counted after its own cordon was visible. Of the nodes that keep theirs, the
    one that counted last saw every other's (each was in place before that one counted), so the
    kept ones are at most the slots."""
    if fleet.nodes <= 0:
        return "won", Verdict(True, 0, 0, "no nodes in scope: the breaker does not apply")
    recent = {n: t for n, t in fleet.sentinel_cordons if in_window(t, now, window_seconds)}
    recent.setdefault(node, now)
    n_slots = slots(fleet.nodes, max_fraction)
    others = len(recent) - 1
    if len(recent) <= n_slots:
        return "won", Verdict(True, others, fleet.nodes,
                              f"{others} other of {fleet.nodes} nodes cordoned by Sentinel in the last "
                              f"{window_seconds:g} s; {len(recent)} <= {n_slots} allowed ({max_fraction:.0%})")
    order = sorted(recent, key=lambda n: (recent[n], n))
    why = (f"{others} other of {fleet.nodes} nodes were cordoned by Sentinel in the last {window_seconds:g} s; "
           f"keeping this one would make {len(recent) / fleet.nodes:.0%} > {max_fraction:.0%}")
    if order.index(node) >= n_slots:
        return "lost", Verdict(False, others, fleet.nodes, why)
    return "wait", Verdict(False, others, fleet.nodes, why)


def decide(fleet: Fleet | None, node: str, now: float, *, max_fraction: float, window_seconds: float) -> Verdict:
    """Allowed unless cordoning ``node`` would make more than ``max_fraction`` of ``fleet.nodes``
    Sentinel-cordoned within ``window_seconds``. No fleet view (file/command backends) or an
    empty one: allowed (there is nothing to count)."""
    if fleet is None or fleet.nodes <= 0:
        return Verdict(True, 0, 0, "no fleet view: the breaker does not apply")
    recent = {n for n, t in fleet.sentinel_cordons if n != node and in_window(t, now, window_seconds)}
    after = (len(recent) + 1) / fleet.nodes
    if after > max_fraction:
        return Verdict(False, len(recent), fleet.nodes,
                       f"{len(recent)} of {fleet.nodes} nodes were cordoned by Sentinel in the last "
                       f"{window_seconds:g} s; cordoning this one would make {after:.0%} > {max_fraction:.0%}")
    return Verdict(True, len(recent), fleet.nodes,
                   f"{len(recent)} of {fleet.nodes} nodes cordoned by Sentinel in the last {window_seconds:g} s; "
                   f"{after:.0%} <= {max_fraction:.0%}")
