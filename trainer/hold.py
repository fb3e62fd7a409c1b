"""The migrate hold's exit: :class:`NodeDrained`, and the SIGTERM that can end a hold.

A rank holds after a migrate snapshot until its node is drained. The membership change reaches it
one of two ways: its heartbeat all-reduce fails on the dead peer, or its own agent's SIGTERM (a
warm spare that moves to the rendezvous' wait list makes every agent restart its workers, and the
agent stops the rest of a worker group once one worker exited). Either way the rank leaves the
same way, by :class:`NodeDrained`, and records why before it exits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger("sentinel.trainer")


class NodeDrained(RuntimeError):
    """A peer left during the migrate hold: the node was drained; exit so torchrun restarts.
    From the raise on, a SIGTERM kills the rank only after ``LEAVING_GRACE_S`` (the caller is exiting)."""


class SigtermDuringHold:
    """``with SigtermDuringHold(step) as stop:`` turns the agent's SIGTERM into :class:`NodeDrained`.

    It is raised only inside ``with stop.waiting():`` (the all-reduce, the sleep): never halfway
    through writing a marker or answering a request; a SIGTERM there is raised by the next
    :meth:`check`. When the hold ends by :class:`NodeDrained` (either way), a SIGTERM gives the
    rank ``LEAVING_GRACE_S`` to finish its exit: a failed all-reduce can bring the rank out before
    the agent's SIGTERM arrives, and the default action would kill it before it records why it
    left. A hold that passes without a drain puts the previous handler back. Outside the main thread signals cannot be caught, and it
    does nothing.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._pending: list[str] = []
        self._waiting = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermDuringHold:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._stopped)
            self._installed = True
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if self._installed:
            leaving = kind is not None and issubclass(kind, NodeDrained)
            signal.signal(signal.SIGTERM, _already_leaving if leaving else self._previous)

    def _stopped(self, signum: int, _frame: Any) -> None:
        why = (f"stopped by the agent ({signal.Signals(signum).name}) during the migrate hold at step "
               f"{self.step}: the membership change began")
        if self._waiting:
            raise NodeDrained(why)
        self._pending.append(why)

    def check(self) -> None:
        """Raise :class:`NodeDrained` for a SIGTERM that came outside a wait."""
        if self._pending:
            raise NodeDrained(self._pending[0])

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The span in which a SIGTERM raises :class:`NodeDrained` at once (the all-reduce, the sleep)."""
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False


# How long a rank that left the hold may take to record why and exit once its agent's SIGTERM came:
# the caller's exit takes milliseconds; a loop that swallowed NodeDrained is stopped after this.
LEAVING_GRACE_S = 5.0


def _already_leaving(signum: int, _frame: Any) -> None:
    """The rank is exiting after NodeDrained: this SIGTERM waits ``LEAVING_GRACE_S`` for that exit,
    then takes effect (the default action; a second SIGTERM takes effect at once). The grace bounds
    how long a loop that caught NodeDrained and went on can hold up its agent's stop."""
    signal.signal(signum, signal.SIG_DFL)
    timer = threading.Timer(LEAVING_GRACE_S, os.kill, (os.getpid(), signum))
    timer.daemon = True
    timer.start()


def hold_for_drain(step: int, seconds: float, beat: float, *, between: Callable[[], None],
                   heartbeat: Callable[[], Any] | None) -> None:
    """Hold a rank at ``step`` for ``seconds`` in beats of ``beat`` s: each beat runs ``between`` (reap
    the disk write, answer late requests), then ``heartbeat`` (the all-reduce whose failure on a dead peer
    means the node was drained: :class:`NodeDrained`), then sleeps. The agent's SIGTERM ends it too."""
    log.warning("migrate snapshot at step %d committed; holding up to %.0f s for the drain", step, seconds)
    with SigtermDuringHold(step) as stop:
        for _ in range(max(1, math.ceil(seconds / beat))):
            between()
            stop.check()
            with stop.waiting():
                if heartbeat is not None:
                    try:
                        heartbeat()
                    except NodeDrained:
                        raise
                    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistBackendError on a dead peer
                        raise NodeDrained(f"a peer left during the migrate hold at step {step}: {exc}") from exc
                time.sleep(beat)
        stop.check()
    log.warning("no drain within %.0f s; training continues", seconds)
