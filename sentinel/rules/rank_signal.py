"""``rank_signal``: a fatal signal sent to a training rank (eBPF)."""

from __future__ import annotations

from sentinel.rules.base import Finding, NodeRule, event_values

BUS_MCEERR_AR, BUS_MCEERR_AO = 4, 5  # SIGBUS si_codes of a memory failure
CONFIRMED = ("kernel", "kernel_ras")  # the probe's kernel record of a memory failure


class RankSignal(NodeRule):
    """A fatal signal reached a training rank. A SIGBUS whose si_code is ``BUS_MCEERR_AR`` (4) or
    ``BUS_MCEERR_AO`` (5) *and* that the kernel generated (the probe's ``memory_failure`` detail is
    ``kernel`` or ``kernel_ras``: see :mod:`sentinel.sources.rank_signals`) is a memory failure
    the kernel found → ``migrate``. The same code without that record was made up by a process
    (``rt_sigqueueinfo`` lets any process send itself any si_code) → ``alert``, cause
    ``rank_signal:SIGBUS:memory_failure_unconfirmed``. Any other SIGBUS (``kill -BUS``, a
    truncated mmap, a full /dev/shm) and any other signal is the job's own business →
    ``alert``; each with its own cause, so none puts a real memory failure into cooldown.

    Source: ``sigaction(2)``, ``rt_sigqueueinfo(2)`` (a process may send itself any si_code),
    the kernel's memory-failure handling (``force_sig_mceerr``/``send_sig_mceerr``)."""

    name = "rank_signal"
    order = 600

    def evaluate(self, event, cfg):
        if event.kind != "rank_signal":
            return None
        d = event.detail
        mceerr = d.get("signal") == "SIGBUS" and d.get("code") in (BUS_MCEERR_AR, BUS_MCEERR_AO)
        memory_failure = mceerr and d.get("memory_failure") in CONFIRMED
        cause = f"{self.name}:{d.get('signal')}"
        note = ""
        if d.get("signal") == "SIGBUS":
            kind = "memory_failure" if memory_failure else "memory_failure_unconfirmed" if mceerr else "not_memory"
            cause = f"{self.name}:SIGBUS:{kind}"
            if memory_failure:
                note = ", memory failure"
            elif mceerr:
                note = (f", a memory-failure code the kernel did not send ({d.get('memory_failure', 'no record')}; "
                        f"sender pid {d.get('sender_pid')})")
        message = (f"{d.get('signal')} (si_code {d.get('code')}{note}) "
                   f"sent to training rank pid {d.get('pid')} ({d.get('comm')})")
        return Finding("migrate" if memory_failure else "alert", cause, message, event_values(event))


RULE = RankSignal()
