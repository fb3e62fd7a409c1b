"""A host powers off (--hosts netns): every process of it SIGKILLed at once, its link removed,
its tmpfs gone with its mount namespace, and no goodbye — its daemon dies with it. The
scheduler (the drill) gives the job a spare; the job must resume from the memory tier, the lost
host's shards from their replicas on other hosts, pulled over the bridge."""

from __future__ import annotations

from sentinel_tools.faults.kill import replace
from sentinel_tools.faults.base import Fault


def inject(drill, victim) -> None:
    drill.power_off(victim)


def verdict(drill, result, outcome) -> bool:
    """At most one recomputed step (the disk interval without the memory tier); with it, the state
    from memory with the lost host's shards from peers, and bytes into the spare's host over the bridge."""
    ok = outcome.base_ok and len(outcome.lost) <= outcome.bound
    if drill.args.memory_interval_steps <= 0:
        return ok
    restore = result["restore"]
    spares = [n.name for n in drill.nodes if n.spare and n.name in outcome.final_nodes]
    into_spares = sum(result.get("bridge_bytes_since_fault", {}).get(n, {}).get("to_host", 0) for n in spares)
    result["power_off"] = {"peer_shards": restore.get("peer", []), "bytes_into_spare_hosts": into_spares,
                           "spare_hosts": spares}
    return ok and restore.get("tier") == "memory" and bool(restore.get("peer")) and into_spares > 0


FAULT = Fault("power-off", "a host powers off (--hosts netns): all its processes SIGKILLed at once, its link and tmpfs "
              "gone, no goodbye", inject, verdict=verdict, follow_up=replace, sudden=True, needs_hosts=True)
