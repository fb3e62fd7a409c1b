"""The slot rendezvous's recovery (:mod:`trainer.slot_rendezvous`): who decides that a slot is
vacant when its node never said it left. Off the fast path; two ways, both on one generation ``f``
that has not committed:

* :meth:`Recovery.keepalive_pass` — the watcher's pass, once per ``admission_timeout``: re-offer a
  vacancy whose spare never came, and declare vacant a slot that did not arrive and whose
  heartbeat did not move over a whole pass (or, on etcd, whose lease ran out). The fallback for
  every kind of loss, including the ones nothing else can tell (a host powered off, cut off,
  paused).
* :meth:`Recovery.probe_pass` — the prober's pass (issue #48, :mod:`trainer.suspects`), every
  ``PROBE_SECONDS`` for one ``admission_timeout`` after a survivor arrived with evidence that a
  peer's process is gone (its workers died of a lost connection): a slot that did not arrive and
  whose agent's liveness socket **refuses** a connect is vacant at once. An agent that accepts
  (alive, however slow) or does not answer (decides nothing) is left to the keep-alive pass.
* :meth:`Recovery.silence_pass` — the waiting spare's pass (issue #41, :mod:`trainer.silence`),
  every probe interval, needing no evidence: a slot whose agent answered none of the probes sent
  over its silence window, on its liveness socket nor on its kernel-answer port (a host powered
  off or cut off: no reset, no answer), while another agent answered and its heartbeat stood
  still, is vacant.

Both write the same thing: ``g<f>/s<slot>`` from absent to ``LEFT:<node id>#<nonce>`` (one
``compare_set``: an arrival and a declaration, or two declarations, cannot both win), then a
vacancy for the spares.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from typing import Any, Callable

from trainer import suspects
from trainer.counting_store import CountingStore
from trainer.silence import SilenceWatch
from trainer.slot_marks import LEFT, arrival, owns

log = logging.getLogger("sentinel.rendezvous")

NO_BEAT_PASSES = 10


class Recovery:
    """The vacancy decisions of one handler. ``key(*parts)`` builds a protocol key;
    ``post_vacancy(slot, f, mark)`` offers a declared slot to the spares; ``on_vacant(event)``
    is told of every declaration (the agent records it for the drill's timeline)."""

    def __init__(self, store: CountingStore, raw: Any, key: Callable[..., str], nodes: int, admission_timeout: float,
                 post_vacancy: Callable[[int, int, str], None],
                 on_vacant: Callable[[dict[str, Any]], None] | None = None, here: str = "") -> None:
        self._store = store
        self._raw = raw
        self._k = key
        self.nodes = nodes
        self.admission_timeout = admission_timeout
        self._post_vacancy = post_vacancy
        self.on_vacant = on_vacant or (lambda event: None)
        self.here = here  # this host's suspects.here(): a loopback address is probed only from its own host
        self._no_beat: dict[int, int] = {}
        self._term: int | None = None  # the store's leader term at the last keep-alive pass (etcd)
        self.disrupted = 0  # keep-alive passes that declared nothing: the store elected a leader since the last
        self._probed_at: dict[tuple[int, int], float] = {}  # (generation, slot) -> its last probe that did not refuse
        self._holders: dict[tuple[int, int], dict[str, Any]] = {}  # (generation, slot) -> its arrival record
        self.declared: list[dict[str, Any]] = []  # every slot this handler declared vacant
        self.probes = {suspects.ALIVE: 0, suspects.GONE: 0, suspects.UNKNOWN: 0}  # probe answers so far
        self.answers: deque[tuple[int, int, str]] = deque(maxlen=1000)  # (generation, slot, answer), newest last

    def _declare(self, f: int, slot: int, mark: str, how: str, evidence: str = "") -> bool:
        """``g<f>/s<slot>`` from absent to ``mark`` plus this declaration's own nonce: two watchers
        declaring the same node write different values, so only the one whose value is there
        posts the vacancy (with the same mark, both would see "theirs" and post two)."""
        mine = f"{mark}#{uuid.uuid4().hex[:8]}"
        got = self._store.compare_set(self._k(f"g{f}", f"s{slot}"), "", mine).decode(errors="replace")
        if got != mine:
            return False  # it arrived (or another watcher declared it) meanwhile
        self._post_vacancy(slot, f, mine)
        event = {"generation": f, "slot": slot, "left": mark[len(LEFT):], "how": how, "evidence": evidence,
                 "time": time.time()}
        self.declared.append(event)
        self.on_vacant(event)
        return True

    # -- the keep-alive pass ------------------------------------------------------------------------
    def keepalive_pass(self, f: int, seen: dict[int, bytes | None]) -> dict[int, bytes | None]:
        """The watcher's pass over generation ``f`` (O(N) checks, once per admission timeout):
        re-offer an unclaimed vacancy whose spare ticket was taken, declare vacant a slot that did
        not arrive and whose heartbeat did not move since the last pass, unless the store elected a
        leader meanwhile (then this pass only records: the window starts again after the
        election). Returns heartbeats seen."""
        now: dict[int, bytes | None] = {}
        dead: list[tuple[int, str]] = []
        tickets = int(self._store.add(self._k("spares"), 0))
        vacancies = int(self._store.add(self._k("vacancies"), 0))
        for s in range(self.nodes):
            key = self._k(f"g{f}", f"s{s}")
            if self._store.check([key]):
                mark = self._store.get(key).decode(errors="replace")
                if mark.startswith(LEFT) and tickets >= vacancies:
                    # its vacancy went to a spare ticket, and nobody claimed it: that spare is gone
                    log.warning("generation %d: slot %d still vacant after %g s: offering it again", f, s,
                                self.admission_timeout)
                    self._post_vacancy(s, f, mark)
                    vacancies += 1
                continue
            hb_key = self._k("hb", s)
            hb = self._store.get(hb_key) if self._store.check([hb_key]) else None
            now[s] = hb
            # unchanged over a whole pass; a slot with no heartbeat at all (its first beat connects
            # in the background) gets NO_BEAT_PASSES passes before it counts as dead
            if hb is None:
                self._no_beat[s] = self._no_beat.get(s, 0) + 1
            # a heartbeat seen on the last pass and gone now, or whose lease ran out: dead (etcd)
            last = hb or seen.get(s) or (self.lease_ran_out(f, s, hb_key) if hb is None else None)
            expired = hb is None and last is not None
            if expired or s in seen and seen[s] == hb and (hb is not None or self._no_beat[s] >= NO_BEAT_PASSES):
                dead.append((s, LEFT + (last.decode(errors="replace").rsplit(":", 1)[0] if last else "unknown")))
        # asked after the reads: an election before or during them voids what they compared
        if dead and self._writable_since_last_pass():
            for s, mark in dead:
                if self._declare(f, s, mark, "keep-alive"):
                    log.warning("generation %d: slot %d neither arrived nor sent a heartbeat for %g s: vacant",
                                f, s, self.admission_timeout)
        elif not dead:
            self._writable_since_last_pass()  # the term this window starts from
        return now

    def _writable_since_last_pass(self) -> bool:
        """False when the store elected a leader since the last pass (its ``leader_term`` moved;
        etcd takes no write between a leader's loss and its successor's election, and a beat begun
        meanwhile lands only after it): over such a window an unmoved heartbeat proves nothing.
        Always True for a store without terms (a TCPStore: one server, nothing to elect)."""
        term = getattr(self._raw, "leader_term", None)
        if not isinstance(term, int):
            return True
        last, self._term = self._term, term
        if last is None or last == term:
            return True
        self.disrupted += 1
        log.warning("the store elected a leader since the last keep-alive pass (term %d -> %d): heartbeats "
                    "are judged over the next %g s instead", last, term, self.admission_timeout)
        return False

    def lease_ran_out(self, f: int, slot: int, hb_key: str) -> bytes | None:
        """A store with leased heartbeats (etcd): when the slot's owner in generation ``f - 1``
        beat on a lease that expired (its heartbeat key is gone: it died without a goodbye), its
        last heartbeat's node part (``<id>:``); else None."""
        owner_of = getattr(self._raw, "beat_owner", None)
        if owner_of is None or f < 2 or not self._store.check([self._k(f"g{f - 1}", f"s{slot}")]):
            return None
        mark = self._store.get(self._k(f"g{f - 1}", f"s{slot}"))  # (bytes: owns() reads any value)
        owner = owner_of(hb_key)
        gone = owner is not None and owns(mark, owner)
        return f"{owner}:".encode() if gone else None

    # -- the probe pass -----------------------------------------------------------------------------
    def _holder(self, f: int, slot: int) -> dict[str, Any]:
        """Slot ``slot``'s arrival record in the committed generation ``f - 1`` (cached: it never
        changes once committed); {} when it has none or left."""
        if (f, slot) not in self._holders:
            key = self._k(f"g{f - 1}", f"s{slot}")
            record: dict[str, Any] = {}
            if self._store.check([key]):
                mark = self._store.get(key)  # (bytes: a value that is no UTF-8 is no arrival record)
                record = arrival(mark) or {}  # (LEFT, or not an arrival record: nobody's)
            self._holders[(f, slot)] = record
        return self._holders[(f, slot)]

    def probe_pass(self, f: int, evidence: str, probe: Callable[[Any], str] = suspects.probe) -> int:
        """Declare vacant every slot of generation ``f`` that has not arrived and whose agent
        (its liveness socket in generation ``f - 1``) refuses a connect. ``evidence``: why this
        survivor probes (kept with the declaration). O(N) checks; a probe per slot not arrived,
        none more often than ``ALIVE_RECHECK`` for a slot found alive or silent. Returns slots declared."""
        declared = 0
        if f < 2:
            return 0
        if any(g < f for g, _ in self._holders):  # a generation committed since: forget the older ones
            self._holders = {k: v for k, v in self._holders.items() if k[0] >= f}
            self._probed_at = {k: v for k, v in self._probed_at.items() if k[0] >= f}
        now = time.monotonic()
        for s in range(self.nodes):
            if now - self._probed_at.get((f, s), -1e9) < suspects.ALIVE_RECHECK:
                continue
            if self._store.check([self._k(f"g{f}", f"s{s}")]):
                continue  # arrived, or already vacant
            holder = self._holder(f, s)
            if "asked" not in holder:  # resolved once per generation and slot
                holder["asked"] = bool(holder.get("probe")) and suspects.reachable_from_here(
                    holder["probe"], holder.get("where"), self.here)
            answer = probe(holder["probe"]) if holder["asked"] else suspects.UNKNOWN
            self.probes[answer] = self.probes.get(answer, 0) + 1
            self.answers.append((f, s, answer))
            if answer != suspects.GONE:
                self._probed_at[(f, s)] = now
            elif answer == suspects.GONE and self._declare(f, s, LEFT + str(holder.get("id", "unknown")), "probe",
                                                           evidence):
                log.warning("generation %d: slot %d's agent is gone (%s refused a connect; evidence: %s): vacant",
                            f, s, holder.get("probe"), evidence)
                declared += 1
        return declared

    # -- the silence pass ---------------------------------------------------------------------------
    def silence_pass(self, f: int, watch: SilenceWatch, closed: Callable[[], bool] = lambda: False) -> int:
        """The waiting spare's pass over generation ``f`` (the one after the committed ``f - 1``):
        probe every agent of ``f - 1`` that can be probed from here (``watch.step``) and declare
        vacant each slot that went silent and has not arrived in ``f``. ``closed()`` is asked only
        before a declaration (a job that ended tears its hosts down). Returns slots declared."""
        if f < 2:
            return 0
        if any(g < f for g, _ in self._holders):
            self._holders = {k: v for k, v in self._holders.items() if k[0] >= f}
        targets = {}
        for s in range(self.nodes):
            holder = self._holder(f, s)
            if "asked" not in holder:
                holder["asked"] = bool(holder.get("probe")) and suspects.reachable_from_here(
                    holder["probe"], holder.get("where"), self.here)
            if holder["asked"]:
                targets[s] = (holder["probe"], suspects.kernel_of(holder))
        declared = 0
        for s, address, window in watch.step(targets, self._beat):
            if closed():
                return declared
            why = f"no answer from {address} for {window:g} s"
            if self._declare(f, s, LEFT + str(self._holder(f, s).get("id", "unknown")), "silence", why):
                log.warning("generation %d: slot %d's host answers nothing (%s, its heartbeat still): vacant",
                            f, s, why)
                declared += 1
        return declared

    def _beat(self, slot: int) -> bytes | None:
        key = self._k("hb", slot)
        return self._store.get(key) if self._store.check([key]) else None
