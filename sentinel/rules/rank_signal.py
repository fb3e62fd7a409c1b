"""``rank_signal``: a fatal signal sent to a training rank (eBPF)."""

from __future__ import annotations

from sentinel.rules.base import Finding, NodeRule, event_values

BUS_MCEERR_AR, BUS_MCEERR_AO = 4, 5  # SIGBUS si_codes of a memory failure, sent only by the kernel


class RankSignal(NodeRule):
    """A fatal signal reached a training rank. A SIGBUS whose si_code is ``BUS_MCEERR_AR`` (4) or
    ``BUS_MCEERR_AO`` (5) is a memory failure the kernel found → ``migrate``. Any other SIGBUS
    (``kill -BUS``, a truncated mmap, a full /dev/shm) and any other signal is the job's own
    business → ``alert``, with its own cause so it never puts a real memory failure into cooldown.

    Source: ``sigaction(2)`` / the kernel's memory-failure handling (only the kernel sends the
    MCEERR codes)."""

    name = "rank_signal"
    order = 600

    def evaluate(self, event, cfg):
        if event.kind != "rank_signal":
            return None
        d = event.detail
        memory_failure = d.get("signal") == "SIGBUS" and d.get("code") in (BUS_MCEERR_AR, BUS_MCEERR_AO)
        cause = f"{self.name}:{d.get('signal')}"
        if d.get("signal") == "SIGBUS":
            cause = f"{self.name}:SIGBUS:{'memory_failure' if memory_failure else 'not_memory'}"
        message = (f"{d.get('signal')} (si_code {d.get('code')}{', memory failure' if memory_failure else ''}) "
                   f"sent to training rank pid {d.get('pid')} ({d.get('comm')})")
        return Finding("migrate" if memory_failure else "alert", cause, message, event_values(event))


RULE = RankSignal()
