"""A host powers off (--hosts netns): every process of it SIGKILLed at once, its link removed,
its tmpfs gone with its mount namespace, and no goodbye — its daemon dies with it. The
scheduler (the drill) gives the job a spare; the job must resume from the memory tier, the lost
host's shards from their replicas on other hosts, pulled over the bridge."""

from __future__ import annotations

import time

from sentinel_tools.faults.base import Fault
from sentinel_tools.faults.kill import replace
from sentinel_tools.harness import progress

ADMITTED_LINE = "admitted: joining the rendezvous"  # trainer.elastic, in a warm spare's agent log
ROUND_DONE_LINE = "rendezvous: group rank"  # trainer.elastic, once the agent's round committed


def inject(drill, victim) -> None:
    drill.power_off(victim)


def verdict(drill, result, outcome) -> bool:
    """At most one recomputed step (the disk interval without the memory tier), no two processes
    stepping as one rank; with the memory tier, the state from memory with the lost host's shards
    from peers, and bytes into the spare's host over the bridge. Records how the lost host's slot
    was declared (``silence``: the waiting spare's rule, #41; ``keep-alive``: expiry; none: c10d)."""
    steps = [e for e in outcome.events if e["event"] == "step" and e["time"] >= outcome.t_fault]
    by_rank_step: dict[tuple[int, int], set[int]] = {}
    for e in steps:
        by_rank_step.setdefault((e["rank"], e["step"]), set()).add(e["pid"])
    twins = sorted(k for k, pids in by_rank_step.items() if len(pids) > 1 and k[1] not in outcome.lost)
    vacant = [e for e in outcome.events if e["event"] == "vacant" and e["time"] >= outcome.t_fault]
    first = min(vacant, key=lambda e: e["time"], default={})
    result["power_off"] = {"declared_by": first.get("how"), "declared_evidence": first.get("evidence"),
                           "same_rank_twice": twins}
    ok = outcome.base_ok and len(outcome.lost) <= outcome.bound and not twins
    if drill.args.memory_interval_steps <= 0:
        return ok
    restore = result["restore"]
    spares = [n.name for n in drill.nodes if n.spare and n.name in outcome.final_nodes]
    into_spares = sum(result.get("bridge_bytes_since_fault", {}).get(n, {}).get("to_host", 0) for n in spares)
    result["power_off"].update(peer_shards=restore.get("peer", []), bytes_into_spare_hosts=into_spares,
                               spare_hosts=spares)
    return ok and restore.get("tier") == "memory" and bool(restore.get("peer")) and into_spares > 0


FAULT = Fault("power-off", "a host powers off (--hosts netns): all its processes SIGKILLed at once, its link and tmpfs "
              "gone, no goodbye", inject, verdict=verdict, follow_up=replace, sudden=True, needs_hosts=True,
              rdzv_default="sentinel",
              rdzv_default_why="the waiting spare of the slot rendezvous tells a host that answers nothing from its "
                               "silence (no reset needed: a powered-off host sends none)")


# -- the etcd leader lost during the replacement (issue #42) --------------------------------------
def replace_then_lose_leader(drill, victims, deadline: float) -> None:
    """The replacement begins with the etcd leader lost: right after the fault, before the scheduler
    admits the spare, the member that leads is SIGKILLed, so the vacancy's declaration, the spare's
    admission and the round all go through an election (a warm spare that watched the silent host
    commits its round within milliseconds of its admission: a kill timed "after the spare joined" came
    after the round in a CI run). The victim's host runs no member (drill_netns places them elsewhere
    for this fault), so two of three stay: a quorum, a new leader, and the round must still commit."""
    t = time.time()
    leader = drill.etcd.probe().get("leader")
    if leader:
        drill.etcd.cluster.stop_member(leader)
    spares = [n for n in drill.nodes if n.spare]
    # the round still open when the leader died: no spare has logged its group rank yet
    in_round = not any(ROUND_DONE_LINE in _read(n.root / "agent.log") for n in spares)
    drill.leader_lost = {"member": leader, "killed_seconds_after_fault": round(time.time() - drill.fault_times[0], 3),
                         "probe_and_kill_seconds": round(time.time() - t, 3), "round_open_when_killed": in_round}
    progress(f"etcd leader {leader} killed as the replacement begins")
    replace(drill, victims, deadline)
    joined = next((n.name for n in spares if ADMITTED_LINE in _read(n.root / "agent.log")), None)
    drill.leader_lost["spare"] = joined


def _read(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def leader_verdict(drill, result, outcome) -> bool:
    """As power-off, and the leader was lost during the round: a new leader, the job on the spare."""
    lost = getattr(drill, "leader_lost", {}) or {}
    after = ((result.get("etcd") or {}).get("at_end") or {}).get("leader")
    result["leader_lost"] = {**lost, "leader_at_end": after}
    return (verdict(drill, result, outcome) and bool(lost.get("member")) and bool(lost.get("round_open_when_killed"))
            and bool(after) and after != lost["member"])


LEADER_REPLACING = Fault(
    "power-off-leader-replacing", "a host without an etcd member powers off; the etcd leader's member is killed as "
    "the replacement begins, before the spare's admission (--hosts netns --rdzv-backend sentinel-etcd)", inject, verdict=leader_verdict,
    follow_up=replace_then_lose_leader, sudden=True, needs_hosts=True, rdzv_backend="sentinel-etcd",
    rdzv_why="the leader of the job's etcd is what it loses")
