"""Rank-preserving rendezvous: a replacement costs each survivor a constant number of store ops.

    python -m trainer.elastic -- --rdzv-backend sentinel --nnodes N:N --rdzv-endpoint HOST:PORT ...

torch's dynamic rendezvous keeps the membership in one blob every agent compare-and-sets: O(N^2)
store work per change, and the ranks are re-numbered (docs/rendezvous.md). Here it is N **slots**:

* slot ``i`` is group rank ``i`` for as long as the job runs; a spare takes a departed node's
  slot (the same group rank, worker ranks, ring and tree neighbours);
* membership changes in **generations**. Generation ``f`` is committed when every slot has
  *arrived* in it: an arrival is one ``compare_set`` of the node's own key ``g<f>/s<slot>`` (no
  other node writes it, so it never conflicts) plus one ``add`` of the counter ``g<f>/n``; the
  arrival that brings the counter to N writes the record ``g<f>`` and ``latest``. Everyone else
  learns the generation with one ``wait`` on ``g<f>`` and one ``get`` of it.
* a survivor's next rendezvous is: ``get latest``, ``compare_set`` its arrival, ``add``,
  ``wait``, ``get`` — 5 store operations whatever N is (a node whose last call timed out after
  it arrived, the generation committing meanwhile, ``get``-s its own mark and joins that one);
* a node that leaves (``leave()``, the agent does it when drained) marks its slot in the forming
  generation ``LEFT:<id>`` and posts a vacancy; the k-th vacancy goes to the spare holding the
  k-th spare ticket, which ``compare_set``-s the slot from ``LEFT:<id>`` to itself. Several
  departures in one generation commit once all their vacancies are filled.

Recovery (off the fast path, by one *watcher*: the first arrival of a generation, or anyone who
waited 3 x ``admission_timeout``): after ``admission_timeout`` without a commit it re-offers a
vacancy no spare claimed (a spare that died mid-admission) and declares vacant a slot that neither
arrived nor advanced its heartbeat over a whole timeout (one that never beat: ``NO_BEAT_PASSES``):
O(N) ``check``-s per timeout. Never in generation 1: ``join_timeout`` bounds the first join.
A sudden loss is told faster from the job's own errors (#48, :mod:`trainer.suspects`): a survivor
whose workers died of a lost connection arrives with that evidence (:meth:`suspect`), and the first
one to do so probes, every ``PROBE_SECONDS`` for one timeout, the agents of the slots that did not
arrive: one whose liveness socket refuses a connect (its process is gone) is vacant at once; one
that accepts (alive, however slow) or does not answer is left to the heartbeat rule
(:mod:`trainer.slot_recovery`). A host that answers nothing at all (powered off, cut off: no
reset, so no evidence) is told by the waiting spare, which probes every agent all the time and
declares a slot whose probes went unanswered over ``silence_window`` (#41, :mod:`trainer.silence`).

A node whose slot was given away in a committed generation (it was declared dead, or replaced, and
came back) is refused with :class:`SlotTakenError` (a ``RendezvousGracefulExitError``: its agent
exits, the job goes on); its heartbeat, ``leave`` and ``shutdown`` are fenced by its generation
(:mod:`trainer.fence`). One declared vacant in the generation still forming re-joins it as a spare.

**When torch's handler is used instead** (``create_handler`` returns torch's
``DynamicRendezvousHandler`` on the same store): when ``--nnodes`` is a range (``MIN < MAX``: an
elastic job that shrinks and grows needs re-numbering, which slots deliberately do not do), or
with ``--rdzv-conf slots=off``. The job's first join uses this module's own counter protocol (one
``add`` for a slot number, then an arrival), not torch's.

Store: torch's c10d TCPStore, through torch's own c10d backend factory (``is_host``,
``store_type`` and timeouts as for ``--rdzv-backend c10d``), or with ``--rdzv-backend
sentinel-etcd`` a replicated etcd v3 (:mod:`trainer.etcd_rendezvous`, :mod:`trainer.etcd_store`):
the store interface used here is ``get set add compare_set check wait clone`` plus an optional
``beat`` (a heartbeat; etcd attaches it to a lease, so a dead host's heartbeat key disappears).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from trainer import silence, suspects, worker_store
from trainer.counting_store import CountingStore, OpStats  # noqa: F401 (re-exported: bench/replacement_scale.py)
from trainer.rdzv_conf import count as _count, seconds as _seconds
from trainer.slot_marks import LEFT, endpoint, generation, next_generation, owns, record as _record, vacancy
from trainer.slot_recovery import NO_BEAT_PASSES, Recovery  # noqa: F401 (re-exported)

log = logging.getLogger("sentinel.rendezvous")

BACKEND = "sentinel"


class SlotTakenError(RendezvousGracefulExitError):
    """This node's slot belongs to another node in a newer generation (it was replaced or declared
    dead): it must not re-join. Its agent exits; the job goes on without it."""


def _is_timeout(exc: BaseException) -> bool:
    return any(word in str(exc).lower() for word in ("timeout", "timed out"))


class SlotRendezvousHandler(RendezvousHandler):
    """N slots, generations, one wait per survivor (module docstring). Blocking calls take at
    most ``join_timeout`` and raise ``RendezvousTimeoutError``; every wait is cut into chunks of
    ``admission_timeout`` so a closed rendezvous (``RendezvousClosedError``) and recovery are seen."""

    def __init__(self, store: Store, run_id: str, nodes: int, *, local_addr: str | None = None,
                 join_timeout: float = 600.0, keep_alive_interval: float = 5.0, keep_alive_max_attempt: int = 3,
                 admission_timeout: float | None = None, node_id: str | None = None,
                 server_factory: Callable[[str], Any] | None = None, backend: str = BACKEND,
                 liveness: bool = True, silence_window: float | None = silence.WINDOW_SECONDS) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string")
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, not {nodes}")
        if join_timeout <= 0 or keep_alive_interval <= 0 or keep_alive_max_attempt < 1:
            raise ValueError("join_timeout and keep_alive_interval must be > 0, keep_alive_max_attempt >= 1")
        self._raw = store
        self.backend = backend
        self.stats = OpStats()  # the protocol's operations
        self.heartbeat_stats = OpStats()  # keep-alives, counted apart
        self._store = CountingStore(store, self.stats)
        self.run_id = run_id
        self.nodes = nodes
        self.addr = local_addr or socket.getfqdn()
        self.node_id = node_id or f"{self.addr}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.join_timeout = join_timeout
        self.keep_alive_interval = keep_alive_interval
        self.admission_timeout = admission_timeout or keep_alive_interval * keep_alive_max_attempt
        self.slot: int | None = None
        self.gen = 0
        self._p = f"sentinel.rdzv.{run_id}"
        self._servers: dict[int, Any] = {}  # generation -> the workers' TCPStore server (slot 0 hosts it)
        self._server_factory = server_factory or self._tcp_server
        self._hb_stop: threading.Event | None = None
        self._hb_thread: threading.Thread | None = None
        self._hb_count = 0
        self._hb_store: CountingStore | None = None
        self._next_server: tuple[threading.Thread, dict[str, Any]] | None = None
        self._forming = 0
        self._first = False
        self._arrived: tuple[int, int] | None = None
        self.last_round: dict[str, Any] = {}
        self.fenced: list[str] = []  # this node's writes refused by the generation fence
        self.epoch = ""  # the job instance (generation 1's commit): fence tokens are (epoch, generation)
        # refuses connects once this process is gone (#48); liveness=False: no socket, keep-alive only
        self.liveness = suspects.Liveness(self.addr if liveness else None)
        self._evidence = ""  # why this node's workers failed, when a peer's process looked gone
        self._here = suspects.here()  # which loopback this node shares (a probe of one must not cross hosts)
        self._probe_every = max(suspects.PROBE_SECONDS, nodes * 0.0005)  # a probe pass is O(N) checks
        self._watch_every = max(silence.INTERVAL_SECONDS, nodes * 0.0005)
        # on by default (--rdzv-conf silence_window=S, =off); None: off (docs/security.md, "The silence rule")
        self._quiet = silence.SilenceWatch(silence_window, self._watch_every) if silence_window else None
        self.recovery = Recovery(self._store, store, self._k, nodes, self.admission_timeout, self._post_vacancy,
                                 on_vacant=suspects.record_vacancy, here=self._here)

    # -- keys ------------------------------------------------------------------------------------------
    def _k(self, *parts: object) -> str:
        return "/".join([self._p, *map(str, parts)])

    # -- RendezvousHandler -------------------------------------------------------------------------
    def get_backend(self) -> str:
        return self.backend

    @property
    def use_agent_store(self) -> bool:
        """Workers connect to the store slot 0's agent starts for each generation (no prefix needed:
        a new store per generation)."""
        return True

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._store.check([self._k("closed")])

    def set_closed(self) -> None:
        self._store.set(self._k("closed"), "1")

    def shutdown(self) -> bool:
        self._stop_heartbeats()
        self.liveness.close()
        try:
            if self._store.fenced_set(self._k("latest"), str(self.gen), self._k("closed"), "1"):
                return True
            self.fenced.append(f"closing the rendezvous from generation {self.gen}")  # not this node's to close
            return False
        except RuntimeError as exc:  # the store is gone: nothing left to close
            log.warning("could not close the rendezvous: %s", exc)
            return False

    def num_nodes_waiting(self) -> int:
        """Nodes that arrived in the next generation (a spare that claimed a slot, a peer that
        restarts): one ``add(key, 0)``. A healthy agent that sees > 0 restarts its workers."""
        if self.slot is None:
            return 0
        return int(self._store.add(self._k(f"g{self.gen + 1}", "n"), 0))

    def next_rendezvous(self) -> RendezvousInfo:
        t0 = time.monotonic()
        before = self.stats.snapshot()
        deadline = t0 + self.join_timeout
        self._stop_heartbeats()
        if self.is_closed():
            raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")
        role = "survivor"
        if self.slot is None:
            role = self._join_or_wait_as_spare(deadline)
            f = self._forming
        else:
            f = self._survivor_arrive()
            if f is None:  # declared vacant in the generation forming: a spare now (_readmit)
                role = self._readmit(deadline)
                f = self._forming
        record = self._await(f, deadline)
        self.gen, self.epoch = f, str(record.get("epoch", ""))
        self._servers = {g: s for g, s in self._servers.items() if g >= f}
        self._start_heartbeats()
        if self.slot == 0:
            self._prepare_server()  # for the next generation
        after = self.stats.snapshot()
        self.last_round = {"role": role, "generation": f, "slot": self.slot, "seconds": time.monotonic() - t0,
                           "ops": after[0] - before[0], "bytes": after[1] + after[2] - before[1] - before[2]}
        log.info("generation %d: slot %d of %d (%s, %d store ops, %.3f s)", f, self.slot, self.nodes, role,
                 self.last_round["ops"], self.last_round["seconds"])
        return RendezvousInfo(self._agent_store(f, record), self.slot, self.nodes,
                              RendezvousStoreInfo(*endpoint(record, self._k(f"g{f}"))))

    def _agent_store(self, f: int, record: dict) -> Store:
        """The agents' store for this generation (torch's agent assigns worker ranks through it):
        a prefix of the rendezvous store when that is a c10d store; else (etcd) the workers'
        TCPStore that slot 0 hosts for this generation, under its own prefix."""
        if isinstance(self._raw, Store):
            return PrefixStore(self._k(f"g{f}", "agents"), self._raw)
        server = self._servers.get(f)
        if server is None:
            server = TCPStore(record["master_addr"], int(record["master_port"]), is_master=False,
                              timeout=timedelta(seconds=max(60.0, self.join_timeout)))
        return PrefixStore("sentinel.agents", server)

    # -- arrivals ------------------------------------------------------------------------------------
    def _info(self, f: int) -> str:
        """This node's arrival record: its id, its liveness socket (``probe``), the evidence it
        arrives with (if any); slot 0 adds the workers' store it hosts for generation ``f``."""
        info: dict[str, Any] = {"id": self.node_id}
        if self.liveness.address:
            info.update(probe=self.liveness.address, kernel=self.liveness.kernel_address, where=self._here)
        if self._evidence:
            info["evidence"] = self._evidence
        if self.slot == 0:
            server = self._servers.get(f)
            if server is None:
                server = self._servers[f] = self._take_server()
            info.update(addr=self.addr, port=server.port)
        return json.dumps(info)

    def suspect(self, evidence: str) -> None:
        """This node's workers died of a lost connection (``evidence``, one line: a peer's process
        looks gone; :func:`trainer.suspects.evidence_of`). Its next arrival carries it, and the
        first survivor of that generation to carry evidence probes the slots that do not arrive
        (:meth:`trainer.slot_recovery.Recovery.probe_pass`)."""
        self._evidence = evidence[:300]

    def _prepare_server(self) -> None:
        """Start the next generation's workers' store now, in a thread: starting a TCPStore server
        connects to itself, and a connect took 5 s in 1 of 40 tries on a loaded host (c10d's
        connect retry) — on the critical path of every waiting node if done inside the round."""
        if self._next_server is not None:
            return
        box: dict[str, Any] = {}

        def make() -> None:
            try:
                box["server"] = self._server_factory(self.addr)
            except RuntimeError as exc:  # taken inline again, where its error is raised
                box["error"] = exc

        thread = threading.Thread(target=make, name="sentinel-rdzv-next-store", daemon=True)
        thread.start()
        self._next_server = (thread, box)

    def _take_server(self) -> Any:
        if self._next_server is not None:
            thread, box = self._next_server
            self._next_server = None
            thread.join()
            if "server" in box:
                return box["server"]
        return self._server_factory(self.addr)

    @staticmethod
    def _tcp_server(addr: str) -> Any:
        return worker_store.serve(addr)  # bound to this node's address only (issue #42 point 4)

    def _claim(self, f: int, expected: str) -> bool:
        """Claim this node's slot in generation ``f`` (``expected``: "" or the departed node's
        ``LEFT:`` mark): one compare_set of a key only this slot's claimants write, one add. True
        when the slot is ours; a re-arrival (the same node calling again in the same generation)
        finds its own mark and does not count twice."""
        self._forming = f
        info = self._info(f)
        got = self._store.compare_set(self._k(f"g{f}", f"s{self.slot}"), expected, info).decode(errors="replace")
        if got != info:
            return False
        if self._arrived != (f, self.slot):
            self._arrived = (f, self.slot)
            n = self._store.add(self._k(f"g{f}", "n"), 1)
            self._first = n == 1
            if n == self.nodes:
                self._commit(f)
        return True

    def _commit(self, f: int) -> None:
        addr, port = endpoint(self._info(f) if self.slot == 0 else self._store.get(self._k(f"g{f}", "s0")),
                              self._k(f"g{f}", "s0"))
        # the job instance: made by generation 1's commit, carried on (a committing spare reads it)
        epoch = self.epoch or (_record(self._store.get(self._k(f"g{f - 1}")), self._k(f"g{f - 1}"), ()).get("epoch", "") if f > 1
                               else uuid.uuid4().hex)
        record = json.dumps({"gen": f, "nodes": self.nodes, "master_addr": addr, "master_port": port,
                             "epoch": epoch})
        self._store.set(self._k(f"g{f}"), record)
        self._store.set(self._k("latest"), str(f))

    def _survivor_arrive(self) -> int | None:
        latest = generation(self._store.get(self._k("latest")), self._k("latest"))
        if latest != self.gen:  # behind: still a member of the latest generation?
            mark = self._store.get(self._k(f"g{latest}", f"s{self.slot}")).decode(errors="replace")
            if not owns(mark, self.node_id):  # (a value that is no arrival record is nobody's)
                raise SlotTakenError(f"slot {self.slot} belongs to another node since generation {latest}")
            # Our own mark: this node arrived in ``latest`` and its call ended (timed out) before the
            # generation committed. The others run it with this slot in it: join it, do not open
            # the next one (nobody else would arrive there).
            return latest
        f = latest + 1
        if self._claim(f, ""):
            return f
        mark = self._store.get(self._k(f"g{f}", f"s{self.slot}")).decode(errors="replace")  # (one get, off the fast path)
        return f if owns(mark, self.node_id) else None  # mine: arrived already, with other evidence; else declared vacant

    def _readmit(self, deadline: float) -> str:
        """This live node's slot was declared vacant in the generation still forming (a keep-alive,
        probe or silence rule judged it dead: a heartbeat that could not land, a probe that timed
        out): it has not stepped in that generation, so it waits as a spare, with a ticket of its own,
        and takes the next vacancy — its own slot when no spare came first, else the one another
        departure left. Its old slot's vacancy was posted by the declaration: the round needs no
        more nodes than it has, and nobody steps as the same rank twice in one generation (a slot
        changes hands only by the compare_set from its ``LEFT`` mark)."""
        log.warning("slot %d was declared vacant in generation %d before this node arrived: it waits for a "
                    "vacancy as a spare", self.slot, self._forming)
        self._servers.pop(self._forming, None)  # made for slot 0's arrival, which did not happen
        self.slot, self._arrived = None, None
        self._spare(deadline)
        return "re-admitted"

    def _join_or_wait_as_spare(self, deadline: float) -> str:
        if not self._store.check([self._k("latest")]):
            t = self._store.add(self._k("join"), 1)
            if t <= self.nodes:
                self.slot = t - 1
                if not self._claim(1, ""):
                    raise SlotTakenError(f"slot {self.slot} of the first generation is taken")
                return "first join"
        return self._spare(deadline)

    def _spare(self, deadline: float) -> str:
        """Wait for a vacancy (the one matching this spare's ticket) and claim its slot."""
        self._prepare_server()  # in case the slot is 0
        seen: dict[int, bytes | None] = {}
        start = time.monotonic()
        next_pass = start + self.admission_timeout

        def probing() -> bool:
            # a spare is admitted because a node is gone (or going): for one timeout it probes the
            # slots that did not arrive, as a survivor with evidence does (#48; all nodes may be dead)
            return time.monotonic() - start < self.admission_timeout

        def watch() -> None:
            # The spare watches the committed generation while it waits: a node that is cut off
            # (or died) with its survivors still blocked in their collectives has nobody else to
            # declare it; its vacancy, then this spare's arrival, is what makes them restart. Every
            # chunk: the silence pass (#41); while just admitted: the probe pass (#48); once per
            # admission timeout: the keep-alive pass.
            nonlocal seen, next_pass
            f = next_generation(self._store, self._k("latest"))
            if f is not None:  # (absent, or malformed: counted, next pass)
                if self._quiet is not None:
                    self.recovery.silence_pass(f, self._quiet, closed=self.is_closed)
                if probing():  # a short connect: a silent slot must not hold the silence pass back
                    self.recovery.probe_pass(f, "a spare was admitted", probe=lambda a: suspects.probe(a, 0.1))
                if not probing() and time.monotonic() >= next_pass:
                    next_pass = time.monotonic() + self.admission_timeout
                    seen = self.recovery.keepalive_pass(f, seen)

        try:
            return self._spare_claim(deadline, watch)
        finally:
            if self._quiet is not None:
                self._quiet.close()

    def watch_silence(self) -> float:
        """One silence pass (#41) by a warm spare still waiting for its admission (``trainer.elastic``
        calls it while it waits): the count it starts goes on once the spare is admitted. A slot
        found silent is declared vacant (its vacancy waits for a spare's ticket). Returns the
        seconds until the next pass. Never raises: a store error waits for the next pass."""
        if self._quiet is None:
            return 0.5  # the rule is off: nothing to watch
        try:
            f = next_generation(self._store, self._k("latest"))
            if f is not None:
                self.recovery.silence_pass(f, self._quiet, closed=self.is_closed)
        except (RuntimeError, OSError, ValueError) as exc:
            log.debug("silence pass before the admission: %s", exc)
        return self._watch_every

    def _spare_claim(self, deadline: float, watch: Callable[[], None]) -> str:
        while True:
            t = self._store.add(self._k("spares"), 1)
            vkey = self._k("vacancy", t)
            self._wait_key(vkey, deadline, f"a vacancy for spare ticket {t}", watch, self._watch_every)
            vac = vacancy(self._store.get(vkey), vkey, self.nodes)
            if vac is None:
                continue  # not a vacancy (counted, logged): a new ticket
            self.slot = vac["slot"]
            f = vac["gen"]
            if self._claim(f, vac["left"]):
                if self.slot != 0:
                    self._next_server = None  # never hosts the workers' store: let it go
                return "spare"
            log.info("vacancy %d (slot %d) was filled by another spare; taking a new ticket", t, self.slot)
            self._servers.pop(f, None)
            self.slot = None

    # -- waiting, recovery ------------------------------------------------------------------------------
    def _wait_key(self, key: str, deadline: float, what: str, between: Callable[[], None], chunk: float) -> None:
        """Wait for ``key`` in chunks of ``chunk`` s, ``between()`` before each; the closed check
        once per ``admission_timeout``."""
        next_check = time.monotonic() + self.admission_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(f"rendezvous {self.run_id}: no {what} within {self.join_timeout:g} s")
            between()
            try:
                self._store.wait([key], timedelta(seconds=min(left, chunk)))
                return
            except RuntimeError as exc:
                if not _is_timeout(exc):
                    raise
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.admission_timeout
                if self.is_closed():
                    raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")

    def _await(self, f: int, deadline: float) -> dict:
        key = self._k(f"g{f}")
        start = time.monotonic()
        watch: dict[int, bytes | None] = {}
        evidence, self._evidence = self._evidence, ""
        # the first survivor to arrive with evidence probes (#48); one add, only when there is evidence
        probing = bool(evidence) and f > 1 and int(self._store.add(self._k(f"g{f}", "evidence"), 1)) == 1
        next_watch = start + self.admission_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(f"rendezvous {self.run_id}: generation {f} not complete within "
                                             f"{self.join_timeout:g} s")
            fast = probing and time.monotonic() - start < self.admission_timeout
            if fast:
                self.recovery.probe_pass(f, evidence)
            try:
                self._store.wait([key], timedelta(seconds=min(left, self._probe_every if fast else self.admission_timeout)))
                return _record(self._store.get(key), key, ("master_addr", "master_port"))
            except RuntimeError as exc:
                if not _is_timeout(exc):
                    raise
            if fast and time.monotonic() < next_watch:
                continue  # probing: the closed check and the keep-alive pass stay once per admission timeout
            next_watch = time.monotonic() + self.admission_timeout
            if self.is_closed():
                raise RendezvousClosedError(f"rendezvous {self.run_id} is closed")
            # generation 1 has no recovery: its nodes may still be starting (importing torch, being
            # scheduled) and never had a heartbeat; join_timeout bounds it, as with torch's first join
            if f > 1 and (self._first or time.monotonic() - start >= 3 * self.admission_timeout):
                watch = self.recovery.keepalive_pass(f, watch)

    def _post_vacancy(self, slot: int, f: int, mark: str) -> None:
        v = self._store.add(self._k("vacancies"), 1)
        self._store.set(self._k("vacancy", v), json.dumps({"slot": slot, "gen": f, "left": mark}))

    # -- leaving ----------------------------------------------------------------------------------------
    def leave(self) -> str:
        """Give this node's slot up: mark it ``LEFT`` in the forming generation and post a vacancy
        for a spare. If this node had already arrived there, the vacancy is for the generation
        after (that one commits with this node in it, its workers never start, and the next
        generation takes the spare). Says what it did."""
        self._stop_heartbeats()
        if self.slot is None:
            return "was not in a slot"
        after = next_generation(self._store, self._k("latest"))  # malformed (counted): from our own
        latest = after - 1 if after is not None else self.gen
        holder = self._store.get(self._k(f"g{latest}", f"s{self.slot}")).decode(errors="replace")
        if latest > self.gen and not owns(holder, self.node_id):
            self._store.refuse()  # fenced: a committed generation holds another node here (its mark never changes)
            self.fenced.append(f"leave of slot {self.slot} in generation {self.gen}")
            return f"fenced: slot {self.slot} belongs to another node since generation {latest}: nothing written"
        mark = LEFT + self.node_id
        for f in (latest + 1, latest + 2):
            got = self._store.compare_set(self._k(f"g{f}", f"s{self.slot}"), "", mark).decode(errors="replace")
            if got == mark:
                self._post_vacancy(self.slot, f, mark)
                slot, self.slot = self.slot, None
                return f"left slot {slot}: vacant in generation {f}"
            if got.startswith(LEFT):
                return f"slot {self.slot} already vacant in generation {f}"
        return f"slot {self.slot}: generation {latest + 2} already claimed (not left)"

    # -- heartbeats -----------------------------------------------------------------------------------
    def _start_heartbeats(self) -> None:
        """A thread that sets ``hb/<slot>`` every ``keep_alive_interval``, on a second connection
        made once, by the thread (a connect can take seconds under load: never inside a round)."""
        self._stop_heartbeats()
        stop = threading.Event()

        def beat() -> None:
            failures = 0
            while True:
                self.liveness.drain()  # probes that queued (a probe is answered by the kernel)
                try:
                    if not self.heartbeat() and not stop.is_set():  # (a stopped round's beat may race the next)
                        self.fenced.append(f"heartbeat of slot {self.slot} in generation {self.gen}")
                        log.warning("slot %d: heartbeat refused, fenced (generation %d is not the job's)", self.slot, self.gen)
                        return
                except RuntimeError as exc:  # the store is unreachable: the watcher decides, not us
                    failures += 1
                    if failures == 1:
                        log.warning("slot %d: heartbeat failed (said once): %s", self.slot, exc)
                if stop.wait(self.keep_alive_interval):
                    return

        self._hb_stop = stop
        self._hb_thread = threading.Thread(target=beat, name=f"sentinel-rdzv-hb-{self.slot}", daemon=True)
        self._hb_thread.start()

    def heartbeat(self) -> bool:
        """One keep-alive of this node's slot (``hb/<slot>``) fenced by its generation: False, nothing
        written, once a newer generation committed without this node. Raises the store's errors."""
        self._hb_count += 1
        if self._hb_store is None:
            self._hb_store = self._store.clone(self.heartbeat_stats)
        beat = f"{self.node_id}:{self._hb_count}"
        return self._hb_store.fenced_beat(self._k("latest"), str(self.gen), self._k("hb", self.slot), beat)

    def _stop_heartbeats(self) -> None:
        if self._hb_stop is not None:
            self._hb_stop.set()
            self._hb_stop = None


# -- creation through torch's registry ------------------------------------------------------------------
def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """``--rdzv-backend sentinel``: the slot handler on torch's c10d store, or torch's own
    ``DynamicRendezvousHandler`` on the same store when the job's size is a range or
    ``--rdzv-conf slots=off`` (module docstring)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend

    slots = str(params.get("slots", "on")).lower()
    if slots not in ("on", "off"):
        raise ValueError(f"--rdzv-conf slots={slots!r}: must be on or off")
    _, store = create_backend(params)
    if slots == "off" or params.min_nodes != params.max_nodes:
        why = "slots=off" if slots == "off" else f"--nnodes {params.min_nodes}:{params.max_nodes} is a range"
        log.info("rendezvous: torch's dynamic rendezvous (%s)", why)

        class FallbackBackend(C10dRendezvousBackend):
            """torch's c10d backend (same state key, same protocol) under this backend's name, which
            torch's registry checks against ``--rdzv-backend``."""

            @property
            def name(self) -> str:
                return BACKEND

        return dynamic_rendezvous.create_handler(store, FallbackBackend(store, params.run_id), params)
    return SlotRendezvousHandler(
        store, params.run_id, params.max_nodes, local_addr=params.local_addr,
        join_timeout=_seconds(params, "join_timeout", 600.0),
        keep_alive_interval=_seconds(params, "keep_alive_interval", 5.0),
        keep_alive_max_attempt=_count(params, "keep_alive_max_attempt", 3),
        silence_window=None if params.get("silence_window") == "off" else _seconds(params, "silence_window", silence.WINDOW_SECONDS),
        admission_timeout=_seconds(params, "admission_timeout", 0.0) if params.get("admission_timeout") else None)


def register() -> None:
    """Make ``--rdzv-backend sentinel`` known to torch's registry (idempotent)."""
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:
        pass  # already registered (by this function, or torchrun's entry point)


def torchrun_entry_point() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: plain torchrun finds ``--rdzv-backend sentinel``."""
    return create_handler
