"""The agent's watch on its rendezvous: keep-alives a starved node cannot lose, evictions judged at
the evaluator's own pace, and one line saying who a stalled round waits for (:mod:`trainer.elastic`
installs it; docs/rendezvous.md, "A round under load").

**torch's dynamic rendezvous** (``--rdzv-backend c10d``, etcd-v2) evicts, in ``_sanitize`` on every
sync of every node, any node whose keep-alive in the shared state is older than
``keep_alive_interval x keep_alive_max_attempt`` by the evaluating node's clock. A keep-alive is a
compare-and-set of the whole state, written by a timer thread that ``next_rendezvous`` stops, or by
the join loop between its polls; it loses to any concurrent writer and waits for the next pass.
A round of N nodes completes only when the N-th node to join still sees the other N-1 fresh: on a
CPU-starved host, where every agent's passes come further apart than the window, each join
evicts the nodes before it, round after round (#47: no round in 3.5 minutes at load ~11). Here:

* **a keep-alive that cannot lose a race**: from its first join until it leaves, each agent's
  thread ``add``-s 1 to its own counter ``sentinel.alive.<run id>.<node>`` every
  ``keep_alive_interval``, on a connection of its own: one store operation, no compare, no
  pickled state, never stopped during a round;
* **eviction judged at the evaluator's pace**: a node whose keep-alive in the state lapsed is
  evicted only when its counter did not move while the evaluating agent's own counter thread beat
  ``keep_alive_max_attempt - 1`` times (observed from when the node's keep-alive became overdue,
  one interval late, so a dead node still goes after about the window, as with torch). A node that runs slowly still beats; an evaluator that is starved
  itself waits for its own beats, which slow down with it. A node whose process or host is gone
  stops beating and is evicted as before.
* **a stalled round says so**: while ``next_rendezvous`` has not returned, every ``report_every``
  seconds the agent logs one line, ``rendezvous stalled: ...``: the round, who is in it and how
  many it needs, who waits for the next one, whose keep-alive lapsed (and whether its counter
  still moves), and whom this node evicted. ``sentinel drill`` prints each agent's last such line
  when the job does not finish.

* **one world per round**: torch's ``_get_world`` answers ``len(state.participants)``, which an
  eviction from a complete round shrinks (for an agent that learns of the completion after it);
  the world is recorded in the state when the round is marked complete and read from there
  (:func:`world_of`).

**The slot rendezvous** (``--rdzv-backend sentinel``) keeps its own heartbeats and recovery
(:mod:`trainer.slot_rendezvous`); only the stall line is added: which slots arrived in the forming
generation, which are vacant, and how long each missing slot's heartbeat has not moved.

Nothing here patches torch's files: the handler's state holder gets this sanitizer as its
``_sanitize``, its op executor the recording ``_mark_rendezvous_complete`` and the handler its
``_get_world`` (instance attributes), checked for torch 2.13 by :func:`install_dynamic`.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from trainer.slot_marks import arrival_id, shown

log = logging.getLogger("sentinel.elastic")

KEY = "sentinel.alive"
MIN_REPORT_SECONDS = 10.0


def report_every(window: float) -> float:
    """How often a stalled round is reported: three keep-alive windows, at least 10 s."""
    return max(MIN_REPORT_SECONDS, 3 * window)


def polling_delay(rdzv: Any, original: Callable[..., None], seconds: Any) -> None:
    """torch's dynamic rendezvous ``_delay``: the 1 s SYNC poll becomes ``poll_seconds``; the
    first-join skew is kept only for the job's first start."""
    if isinstance(seconds, tuple):
        if rdzv.skew:
            original(seconds)
        return
    if seconds == 1:
        seconds = rdzv.poll_seconds
    if seconds > 0:
        time.sleep(seconds)


class Liveness:
    """This node's counter thread (``start``/``stop``) and the reader of the others' counters."""

    def __init__(self, store: Any, run_id: str, node: str, interval: float) -> None:
        self.store = store  # the rendezvous store; the thread makes its own connection (clone)
        self.prefix = f"{KEY}.{run_id}."
        self.node = node
        self.interval = interval
        self.beats = 0
        self._stop: threading.Event | None = None

    def key(self, node: str) -> str:
        return self.prefix + node

    def start(self) -> None:
        if self._stop is not None:
            return
        stop = self._stop = threading.Event()
        threading.Thread(target=self._run, args=(stop,), name="sentinel-rdzv-alive", daemon=True).start()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    def _run(self, stop: threading.Event) -> None:
        store = None
        failures = 0
        while not stop.is_set():
            try:
                if store is None:  # a connect can take seconds under load: here, never inside a round
                    clone = getattr(self.store, "clone", None)
                    store = clone() if clone is not None else self.store
                store.add(self.key(self.node), 1)
                self.beats += 1
            except Exception as exc:  # noqa: BLE001 - the store is unreachable: the others decide; say it once
                failures += 1
                if failures == 1:
                    log.warning("rendezvous keep-alive counter: %s: %s (said once)", type(exc).__name__, exc)
            if stop.wait(self.interval):
                return

    def counter(self, node: str) -> int | None:
        """Another node's counter (0: it never beat), or None when the store cannot say."""
        try:
            return int(self.store.add(self.key(node), 0))
        except Exception:  # noqa: BLE001 - not observed: nobody is evicted on a read that failed
            return None


class Sanitizer:
    """The state holder's ``_sanitize``: torch's, except that a node whose keep-alive lapsed is
    evicted only when its counter stood still at this node's own pace (module docstring)."""

    def __init__(self, holder: Any, settings: Any, liveness: Liveness, epilogue: Callable[[Any, Any], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.holder = holder
        self.clock = clock
        self.settings = settings
        self.live = liveness
        self.epilogue = epilogue  # torch's _remove_participant_epilogue
        self.seen: dict[Any, tuple[int | None, int, float]] = {}  # node -> (its counter, this node's beats, clock)
        self.evicted: dict[str, int] = {}  # node -> evictions this agent made
        self.spared: dict[str, float] = {}  # node -> its keep-alive's age when last kept for its counter

    @property
    def window(self) -> float:
        return self.settings.keep_alive_interval.total_seconds() * self.settings.keep_alive_max_attempt

    def dead(self, state: Any) -> list[Any]:
        """Nodes to evict: keep-alive in the state older than the window, and the counter unchanged
        since this node first saw the keep-alive overdue, over ``keep_alive_max_attempt - 1`` of this
        node's own beats (each at least an interval apart: the span scales with this node's pace)
        and over ``window - interval`` by this node's clock (first seen overdue an interval after
        its last beat: the counter stood still for the window). Without the clock's part, two of
        this node's beats (on resume and an interval later) could fall in one run of this node
        while the other was paused for less than the window."""
        interval = self.settings.keep_alive_interval.total_seconds()
        attempts = self.settings.keep_alive_max_attempt
        wall, now = datetime.now(timezone.utc), self.clock()
        overdue = {n: (wall - t).total_seconds() for n, t in state.last_heartbeats.items()
                   if (wall - t).total_seconds() > interval}
        for node in list(self.seen):
            if node not in overdue:
                del self.seen[node]  # it beat in the state again: watched afresh when next overdue
                self.spared.pop(repr(node), None)
        dead = []
        for node, age in overdue.items():
            value = self.live.counter(repr(node))
            before = self.seen.get(node)
            if value is None or before is None or before[0] != value:
                self.seen[node] = (value, self.live.beats, now)
            elif (age > self.window and self.live.beats - before[1] >= max(1, attempts - 1)
                  and now - before[2] >= self.window - interval):
                dead.append(node)
                continue
            if age > self.window:
                self.spared[repr(node)] = age
        return dead

    def __call__(self) -> None:
        state = self.holder._state
        dead = self.dead(state)
        removed = False
        for node in dead:
            age = (datetime.now(timezone.utc) - state.last_heartbeats.pop(node)).total_seconds()
            name = repr(node)
            self.evicted[name] = self.evicted.get(name, 0) + 1
            self.seen.pop(node, None)
            self.spared.pop(name, None)
            log.warning("rendezvous: evicting %s from round %d: no keep-alive for %.1f s and its counter did not "
                        "move over %d of this node's beats", name, state.round, age,
                        self.settings.keep_alive_max_attempt - 1)
            removed = state.participants.pop(node, None) is not None or removed
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        self.holder._dead_nodes = dead
        if removed:
            self.epilogue(state, self.settings)


def describe_dynamic(state: Any, settings: Any, me: Any, sanitizer: Sanitizer | None, waited: float,
                     counters: dict[str, int | None] | None = None) -> str:
    """The one line of a stalled dynamic rendezvous (pure: the state and what was observed)."""
    wall = datetime.now(timezone.utc)
    window = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
    counters = counters or {}

    def who(node: Any) -> str:
        age = (wall - state.last_heartbeats[node]).total_seconds() if node in state.last_heartbeats else None
        text = repr(node) + (" (this node)" if node == me else "")
        if age is None:
            return text + " (no keep-alive)"
        text += f" (keep-alive {age:.1f} s ago"
        if age > window:
            text += ", lapsed" + (f", counter {counters[repr(node)]}" if counters.get(repr(node)) is not None else "")
        return text + ")"

    need = (f"{settings.min_nodes}" if settings.min_nodes == settings.max_nodes
            else f"{settings.min_nodes} to {settings.max_nodes}")
    parts = [f"rendezvous stalled: {settings.run_id} round {state.round} "
             f"{'complete' if state.complete else 'not complete'} after {waited:.0f} s of this node's join",
             f"in the round {len(state.participants)} of {need} needed: "
             + (", ".join(who(n) for n in sorted(state.participants)) or "nobody")]
    if state.wait_list:
        parts.append("waiting for the next round: " + ", ".join(who(n) for n in sorted(state.wait_list)))
    if state.redundancy_list:
        parts.append("redundant: " + ", ".join(who(n) for n in sorted(state.redundancy_list)))
    if state.closed:
        parts.append("the rendezvous is closed")
    if me not in state.participants and me not in state.wait_list:
        parts.append(f"this node {me!r} is in neither list")
    if sanitizer is not None and sanitizer.evicted:
        parts.append("evicted by this node (keep-alive lapsed, counter still): "
                     + ", ".join(f"{n} x{k}" for n, k in list(sanitizer.evicted.items())))  # list(): atomic copy
    if sanitizer is not None and sanitizer.spared:
        parts.append("kept though their keep-alive lapsed (counter moving): " + ", ".join(sorted(sanitizer.spared)))
    return "; ".join(parts)




def describe_slots(store: Any, prefix: str, nodes: int, forming: int, waited: float,
                   hb_changed: dict[int, tuple[bytes | None, float]], now: float) -> str:
    """The one line of a stalled slot rendezvous, read from the store (``check`` before every
    ``get``: a c10d get of a missing key blocks). ``hb_changed``: per slot, the heartbeat last seen
    and when it last changed (updated here)."""
    def key(*parts: object) -> str:
        return "/".join([prefix, *map(str, parts)])

    def read(k: str) -> bytes | None:
        return store.get(k) if store.check([k]) else None

    latest = read(key("latest"))
    f = forming or (int(latest) + 1 if latest else 1)
    committed = shown(latest.decode(errors="replace")) if latest else "none"
    arrived, vacant, missing = [], [], []
    for s in range(nodes):
        mark = read(key(f"g{f}", f"s{s}"))
        hb = read(key("hb", s))
        last, since = hb_changed.get(s, (None, now))
        if hb != last:
            since = now
        hb_changed[s] = (hb, since)
        if mark is None:
            missing.append(f"slot {s} (" + ("no heartbeat" if hb is None else f"heartbeat unchanged for {now - since:.1f} s")
                           + ")")
        elif mark.startswith(b"LEFT:"):
            vacant.append(f"slot {s}")
        else:
            arrived.append(f"slot {s} ({shown(arrival_id(mark))})")
    tickets = int(store.add(key("spares"), 0))
    vacancies = int(store.add(key("vacancies"), 0))
    return (f"rendezvous stalled: generation {f} (committed: {committed}) not committed "
            f"after {waited:.0f} s of this node's join; arrived {len(arrived)} of {nodes}: {', '.join(arrived) or 'none'}; "
            f"waiting for: {', '.join(missing) or 'nobody'}; vacant, for a spare: {', '.join(vacant) or 'none'}; "
            f"spare tickets {tickets}, vacancies posted {vacancies}")


@contextlib.contextmanager
def stall_reports(describe: Callable[[float], str], every: float) -> Iterator[None]:
    """While the block runs, ``describe(waited)`` is logged every ``every`` seconds (a thread; an
    empty line, nothing to report, is not logged)."""
    done = threading.Event()
    t0 = time.monotonic()

    def watch() -> None:
        while not done.wait(every):
            try:
                line = describe(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - a report that cannot be read still says so
                line = f"rendezvous stalled: {time.monotonic() - t0:.0f} s of this node's join; state unreadable " \
                       f"({type(exc).__name__}: {shown(str(exc), 300)})"
            if line:
                log.warning("%s", line)

    thread = threading.Thread(target=watch, name="sentinel-rdzv-stall", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


WORLD = "sentinel_world"  # on torch's state: (round, its world size when it was marked complete)


def world_of(state: Any, node: Any, max_nodes: int | None = None) -> tuple[int, int]:
    """This node's rank and the world of its complete round: the size the round had when it was
    marked complete (recorded in the same compare-and-set), not how many participants are left.
    torch's ``_get_world`` returns ``len(state.participants)``, but a complete round loses
    participants afterwards (``_sanitize`` evicts a node whose keep-alive lapsed, in every sync
    and before the join sees the state), so a participant that learns of the completion after an
    eviction, its own or one committed by another node, would get a smaller world than the others
    got from the same round (#47: ranks 0, 1, 2 in worlds 3, 2, 3).

    The record comes from the c10d store, which any user who reaches it can write: a world that
    is not a whole number at least the participants left and this rank + 1 (and at most
    ``max_nodes``) is not used (a warning; torch's answer instead), never raised on."""
    recorded = getattr(state, WORLD, None)
    rank = state.participants[node]
    if type(recorded) is tuple and len(recorded) == 2 and type(recorded[0]) is int and recorded[0] == state.round:
        world = recorded[1]
        if (type(world) is int and world >= max(len(state.participants), rank + 1)
                and (max_nodes is None or world <= max_nodes)):
            return rank, world
        log.warning("round %d: the world recorded in the rendezvous state (%.40r) is not one this round can "
                    "have: the participants' count is used", state.round, world)
    return rank, len(state.participants)  # completed by an agent without this watch: torch's answer


def record_world(executor: Any) -> Callable[[], None]:
    """The executor's ``_mark_rendezvous_complete``, which also records the round's world size in
    the state it is about to write (one compare-and-set with ``complete`` and the ranks)."""
    original = executor._mark_rendezvous_complete

    def mark_complete() -> None:
        original()
        state = executor._state
        setattr(state, WORLD, (state.round, len(state.participants)))

    return mark_complete


class DynamicWatch:
    """What :func:`install_dynamic` set up on one handler: the counter thread, the sanitizer, the
    world of a complete round as recorded at its completion."""

    def __init__(self, handler: Any, dr: Any) -> None:
        self.handler = handler
        settings = handler._settings
        self.liveness = Liveness(handler._store, settings.run_id, repr(handler._this_node),
                                 settings.keep_alive_interval.total_seconds())
        self.sanitizer = Sanitizer(handler._state_holder, settings, self.liveness, dr._remove_participant_epilogue)
        handler._state_holder._sanitize = self.sanitizer
        handler._op_executor._mark_rendezvous_complete = record_world(handler._op_executor)
        handler._get_world = lambda: world_of(handler._state_holder.state, handler._this_node,
                                                handler._settings.max_nodes)

    def describe(self, waited: float) -> str:
        holder = self.handler._state_holder
        got = holder._backend.get_state()
        state = pickle.loads(got[0]) if got is not None else holder.state
        if state.complete and self.handler._this_node in state.participants:
            return ""  # done: this node's join returns at its next pass
        counters = {repr(n): self.liveness.counter(repr(n)) for n in state.last_heartbeats}
        return describe_dynamic(state, self.handler._settings, self.handler._this_node, self.sanitizer, waited, counters)

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """Around ``next_rendezvous``: the counter runs from the first join on; stalls are reported."""
        self.liveness.start()
        window = self.sanitizer.window
        with stall_reports(self.describe, report_every(window)):
            yield

    def stop(self) -> None:
        self.liveness.stop()


def install_dynamic(handler: Any, dr: Any) -> DynamicWatch | None:
    """Set the watch up on a torch ``DynamicRendezvousHandler``; None (torch's own behaviour) when
    the internals it relies on changed."""
    holder = getattr(handler, "_state_holder", None)
    executor = getattr(handler, "_op_executor", None)
    needed = (hasattr(handler, "_settings") and hasattr(handler, "_store") and hasattr(handler, "_this_node")
              and holder is not None and hasattr(holder, "_sanitize") and hasattr(holder, "_backend")
              and hasattr(dr, "_remove_participant_epilogue") and hasattr(handler, "_get_world")
              and hasattr(executor, "_mark_rendezvous_complete"))
    return DynamicWatch(handler, dr) if needed else None


def slot_round(handler: Any, next_rendezvous: Callable[[], Any]) -> Callable[[], Any]:
    """The slot handler's ``next_rendezvous`` with stall reports (read on its own connection, so
    the protocol's operation counts stay the protocol's)."""
    hb_changed: dict[int, tuple[bytes | None, float]] = {}
    reader: list[Any] = []

    def describe(waited: float) -> str:
        if not reader:
            raw = handler._raw
            reader.append(raw.clone() if hasattr(raw, "clone") else raw)
        forming = handler._forming if handler.slot is not None and handler._forming > handler.gen else 0
        return describe_slots(reader[0], handler._p, handler.nodes, forming, waited, hb_changed, time.monotonic())

    def wrapped() -> Any:
        every = report_every(handler.admission_timeout)
        with stall_reports(describe, every):
            return next_rendezvous()

    return wrapped
