"""``python -m trainer.elastic``: torchrun for a fast node replacement.

    python -m trainer.elastic [--warm] [--preload MODULE]... [--state-dir DIR] [--ready-file PATH]
        [--rdzv-poll-seconds S] -- <torchrun arguments> -m trainer.train ...

It takes torchrun's own arguments after ``--`` and runs torch's own ``LocalElasticAgent`` and
rendezvous handler; what differs answers one measured slow path of a node replacement each
(``README.md``, "Migration in under 3 seconds"):

* **Workers start from a preloaded forkserver.** A worker started by torchrun is a fresh
  interpreter that imports torch (1-3 s on a loaded 2-core host). Here the ``-m`` module runs as
  a function entry point under the ``forkserver`` start method, and the forkserver imports torch,
  what torch imports lazily on a worker's first steps (:mod:`trainer.warmup`) and every
  ``--preload`` module once, when the agent starts: a worker is a ``fork()`` of it. The
  forkserver itself is forked from the agent once the agent has imported them
  (:mod:`trainer.forkserver`: one torch import per node, not two), or started as a new
  interpreter where that is not safe. Only preload a training module that can be imported
  without side effects (its work is under ``if __name__ == "__main__"``); the agent and the
  forkserver never initialise CUDA, so forking them is safe.
* **--warm: a spare that does not join.** The agent starts completely — torch imported,
  forkserver up with the preloaded modules, the rendezvous handler connected to its store — and
  then waits, *outside* the rendezvous, for SIGUSR1 (``sentinel admit``). A spare inside the
  rendezvous would make every rank crash a re-rendezvous of N+1 nodes for N slots, forever.
  SIGTERM/SIGINT/SIGHUP before the admission exit 0. ``--ready-file`` is written once warm.
* **A node that leaves says so.** torch keeps a SIGTERMed agent as a participant of the completed
  round (``launch_agent`` deliberately skips ``shutdown()``, which would close the rendezvous for
  everyone), and a participant leaving a completed round does not end it, so survivors wait for
  its keep-alive to expire (``keep_alive_interval`` x ``keep_alive_max_attempt``). Here the agent
  removes itself from the rendezvous state first (c10d: participants, wait list and redundancy
  list; etcd-v2: its keep-alive key, which the survivors watch), *then* stops its workers.
* **A node being drained never re-joins.** When its workers fail (a peer was drained first) and
  ``--state-dir`` holds a cordon marker or a Sentinel migration record, the agent stops its
  workers, leaves the rendezvous and exits 0 instead of restarting them: several nodes drained at
  once make one membership change, not one per node.
* **The workers' store, from the agent, every round.** torch caches the first round's worker-store
  address for good (plain torchrun needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the rank-0
  *worker* hosts it, the others' connects are retried with backoff, 0.4-0.7 s). This agent
  forgets it every round: the new rank 0's agent starts the store before any worker exists.
* **Rendezvous polling.** torch polls its backend once a second while it waits (``_delay(seconds=1)``)
  from a 1 s cache: up to 2 s of pure waiting. During ``next_rendezvous`` this agent polls every
  ``--rdzv-poll-seconds`` without the cache. torch's 0-0.3 s first-join skew stays for the job's
  first start only.
* **A round that converges under load** (:mod:`trainer.rdzv_watch`): torch evicts a node whose
  keep-alive (a compare-and-set of the whole state) is 3 windows late, which on a starved host
  evicted live nodes round after round. Each agent also beats a counter of its own (one ``add``
  per interval, its own thread and connection) and evicts a late node only when that counter
  stood still at the evaluator's own pace; a round stalled for 10 s logs ``rendezvous stalled:``
  with who is in it, who waits, whose keep-alive lapsed.

* **--rdzv-backend sentinel: rank-preserving replacement** (:mod:`trainer.slot_rendezvous`,
  registered in torch's ``rendezvous_handler_registry``): the job is N slots; a spare takes the
  departed node's slot and group rank, a survivor's re-rendezvous is 6 store operations whatever N
  is, and workers that died of a lost connection are its evidence of a dead peer (#48). With
  ``--nnodes MIN:MAX`` (MIN < MAX) or ``--rdzv-conf slots=off``: torch's dynamic rendezvous on the
  same store (docs/rendezvous.md); ``sentinel-etcd``: the same handler on etcd (:mod:`trainer.etcd_rendezvous`).

The c10d/etcd-v2 parts reach into torch's private rendezvous internals (checked for torch 2.13); when
they are missing the agent logs a warning and runs with torch's own (slower, still correct) behaviour."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from trainer import rdzv_watch, store_deadline

log = logging.getLogger("sentinel.elastic")

DEFAULT_POLL_SECONDS = 0.1
LEAVE_TIMEOUT_SECONDS = 5.0
WARM_WAIT_BEAT = 1.0


class NodeLeaving(RuntimeError):
    """This node is being drained: its agent left the rendezvous instead of restarting workers."""


# -- the worker entry point (runs in a process forked from the preloaded forkserver) ---------------
def run_module(module: str, *argv: str) -> None:
    """Run ``python -m module argv...`` in this (already warm) interpreter."""
    import runpy
    import warnings

    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():  # "found in sys.modules": it was preloaded, which is the point
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def run_script(path: str, *argv: str) -> None:
    import runpy

    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


# -- rendezvous: leave, tune -------------------------------------------------------------------------
class Rendezvous:
    """The agent's rendezvous handler plus what torch does not offer: ``leave()`` and faster polling."""

    def __init__(self, handler: Any, poll_seconds: float) -> None:
        self.handler = handler
        self.poll_seconds = poll_seconds
        self.kind = ""
        self.lease_path: str | None = None  # etcd-v2: this node's keep-alive key in the current round
        self.lease_stop: Any = None
        self.skew = True  # torch's 0-0.3 s first-join skew: only for the job's first start
        self.problems: list[str] = []
        from trainer.slot_rendezvous import SlotRendezvousHandler

        self.watch: Any = None  # c10d/etcd-v2: trainer.rdzv_watch's keep-alive counter and sanitizer
        if isinstance(handler, SlotRendezvousHandler):
            self.kind = "slot"  # rank-preserving: its own leave(), no polling to tune; a stalled round says so
            handler.next_rendezvous = rdzv_watch.slot_round(handler, handler.next_rendezvous)
            return
        try:
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

            if isinstance(handler, dr.DynamicRendezvousHandler):
                self._tune_dynamic(dr)
                return
        except ImportError:
            pass
        impl = getattr(handler, "_rdzv_impl", None)
        if impl is not None and hasattr(impl, "setup_lease_renewal"):
            self._tune_etcd(impl)
        else:
            self.problems.append(f"{type(handler).__name__}: no graceful leave for this backend")

    # c10d (and any DynamicRendezvousHandler backend)
    def _tune_dynamic(self, dr: Any) -> None:
        holder = getattr(self.handler, "_state_holder", None)
        if holder is None or not hasattr(holder, "_cache_duration") or not hasattr(self.handler, "_op_executor"):
            self.problems.append("torch's DynamicRendezvousHandler internals changed: default polling, no graceful leave")
            return
        self.kind = "dynamic"
        self.watch = rdzv_watch.install_dynamic(self.handler, dr)
        if self.watch is None:
            self.problems.append("torch's rendezvous state holder changed: torch's keep-alive eviction, no stall reports")
        original_delay = getattr(dr, "_sentinel_original_delay", dr._delay)
        dr._sentinel_original_delay = original_delay
        dr._delay = functools.partial(rdzv_watch.polling_delay, self, original_delay)
        original_next = self.handler.next_rendezvous
        # torch keeps the first round's worker-store address (``_bootstrap_store_info``) for every
        # later round unless the node is rank 0 without a store: after a membership change a spare
        # waits forever for a MASTER_ADDR the new rank 0 never publishes (it kept its old one), and
        # a survivor points its workers at the store of a node that was drained. Forget it every
        # round: the new rank 0's agent starts the workers' store before its workers exist (no
        # worker's connection is refused and retried with backoff, 0.4-0.7 s here, as when
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 makes the rank-0 worker host it).
        fresh_store_info = hasattr(self.handler, "_bootstrap_store_info") and hasattr(self.handler, "_shared_tcp_store_server")
        if not fresh_store_info:
            self.problems.append("torch's DynamicRendezvousHandler keeps no worker-store address: set "
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for membership changes")

        def next_rendezvous():
            saved = holder._cache_duration
            holder._cache_duration = 0
            if fresh_store_info:
                self.handler._bootstrap_store_info = None
                self.handler._shared_tcp_store_server = None  # rank 0 of the new round starts a new one
            try:
                with self.watch.round() if self.watch is not None else contextlib.nullcontext():
                    return original_next()
            finally:
                holder._cache_duration = saved
                self.skew = False

        self.handler.next_rendezvous = next_rendezvous

    def sync(self) -> None:
        """Read the current rendezvous state (no join): the round number, so a warm spare's first
        join is not treated as the job's first start."""
        if self.kind == "dynamic":
            self.handler._state_holder.sync()
            self.skew = False

    # etcd-v2
    def _tune_etcd(self, impl: Any) -> None:
        self.kind = "etcd"
        original = impl.setup_lease_renewal

        def setup_lease_renewal(full_path, ttl):
            stop = original(full_path, ttl)
            if "/rank_" in str(full_path):
                self.lease_path, self.lease_stop = full_path, stop
            return stop

        impl.setup_lease_renewal = setup_lease_renewal

    def leave(self) -> str:
        """Remove this node from the rendezvous state now (bounded: LEAVE_TIMEOUT_SECONDS). Never
        raises; says what it did. A SIGTERM/SIGINT/SIGHUP arriving meanwhile (the drain's SIGTERM
        lands right when a drained node's workers fail) is held until the leave is written, then
        delivered again: torch's handler would otherwise abort the leave halfway, and the others
        would wait for this node's keep-alive to expire."""
        import threading

        held: list[int] = []
        saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                saved[sig] = signal.signal(sig, lambda signum, _frame: held.append(signum))
        try:
            if self.kind == "slot":
                return self.handler.leave()
            if self.kind == "dynamic":
                return self._leave_dynamic()
            if self.kind == "etcd":
                return self._leave_etcd()
            return "no graceful leave for this backend"
        except Exception as exc:  # noqa: BLE001 - leaving is an optimisation: keep-alive expiry still works
            log.warning("could not leave the rendezvous (%s: %s); the others wait for keep-alive expiry",
                        type(exc).__name__, exc)
            return f"leave failed: {exc}"
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
            if held:
                os.kill(os.getpid(), held[0])  # now handled as it would have been

    def _leave_dynamic(self) -> str:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        handler = self.handler
        handler._stop_heartbeats()
        if self.watch is not None:
            self.watch.stop()
        where: list[str] = []

        def leave_op(ctx, deadline):
            if time.monotonic() > deadline:
                return dr._Action.ERROR_TIMEOUT
            if ctx.node in ctx.state.participants:
                where.append("participants")
                return dr._Action.REMOVE_FROM_PARTICIPANTS
            if ctx.node in ctx.state.wait_list:
                where.append("wait list")
                return dr._Action.REMOVE_FROM_WAIT_LIST
            if ctx.node in ctx.state.redundancy_list:
                where.append("redundancy list")
                return dr._Action.REMOVE_FROM_REDUNDANCY_LIST
            return dr._Action.FINISH

        with handler._heartbeat_lock:
            handler._state_holder._cache_duration = 0
            handler._op_executor.run(leave_op, time.monotonic() + LEAVE_TIMEOUT_SECONDS)
        return "left the " + " and ".join(dict.fromkeys(where)) if where else "was not in the rendezvous"

    def _leave_etcd(self) -> str:
        if self.lease_path is None:
            return "was not in the rendezvous"
        if self.lease_stop is not None:
            self.lease_stop.set()
        impl = self.handler._rdzv_impl
        try:
            impl.client.delete(self.lease_path)
        except Exception as exc:  # noqa: BLE001 - etcd.EtcdKeyNotFound: its TTL already expired
            return f"keep-alive key already gone ({type(exc).__name__})"
        path, self.lease_path = self.lease_path, None
        return f"deleted keep-alive key {path}"


# -- the agent ---------------------------------------------------------------------------------------
def _make_agent_class():
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

    from trainer import fence, suspects

    class FastAgent(LocalElasticAgent):
        """torch's LocalElasticAgent that leaves the rendezvous before stopping its workers and
        never re-joins while its node is being drained."""

        def __init__(self, *args, rendezvous: Rendezvous, draining: Callable[[], str], **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._sentinel_rdzv = rendezvous
            self._sentinel_draining = draining
            self._sentinel_left = False
            self.graceful_exit = ""  # why the rendezvous let this node go (its slot was given away)

        def _sentinel_leave(self, why: str) -> None:
            if not self._sentinel_left:
                self._sentinel_left = True
                what = self._sentinel_rdzv.leave()
                log.warning("%s: %s", why, what)

        def _restart_workers(self, worker_group) -> None:
            reason = self._sentinel_draining()
            if reason:
                self._sentinel_leave(f"not re-joining ({reason})")  # first: the others are waiting on it
                self._stop_workers(worker_group)
                raise NodeLeaving(reason)
            log.info("restarting the worker group (%s)", worker_group.state.name)
            super()._restart_workers(worker_group)

        def _rendezvous(self, worker_group) -> None:
            t = time.monotonic()
            try:
                super()._rendezvous(worker_group)
            except RendezvousGracefulExitError as exc:  # e.g. SlotTakenError: torch's run() returns None
                self.graceful_exit = str(exc) or type(exc).__name__
                raise
            log.info("rendezvous: group rank %d of %d in %.3f s", worker_group.group_rank,
                     worker_group.group_world_size, time.monotonic() - t)

        def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
            # torch builds the workers' environment itself (no hook) and calls this with it just
            # before it starts them: the slot rendezvous's generation, the fencing token of their
            # snapshot commits (trainer.fence)
            handler = self._sentinel_rdzv.handler
            generation, epoch = getattr(handler, "gen", 0), getattr(handler, "epoch", "")
            if isinstance(generation, int) and generation > 0 and epoch:
                for env in envs.values():
                    env[fence.ENV] = fence.token_env(epoch, generation)
            super()._setup_local_watchdog(envs=envs)

        def _start_workers(self, worker_group):
            t = time.monotonic()
            pids = super()._start_workers(worker_group)
            log.info("started %d worker(s) in %.3f s", len(pids), time.monotonic() - t)
            return pids

        def _shutdown(self, death_sig=None, timeout: int = 30) -> None:
            # torch calls this with the signal when the agent got SIGTERM/SIGINT (before it stops
            # the workers), and without one from _stop_workers and at the end of run(). On a
            # signal, leave first, so the survivors' re-rendezvous does not wait for this node's
            # keep-alive to expire.
            if death_sig is not None and self._worker_group.state != WorkerState.SUCCEEDED:
                self._sentinel_leave(f"stopping ({getattr(death_sig, 'name', death_sig)})")
            super()._shutdown(signal.SIGTERM if death_sig is None else death_sig, timeout)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state != WorkerState.HEALTHY:
                log.info("worker group %s", result.state.name)
                suspects.report(self._sentinel_rdzv.handler, result.failures)  # a peer's process gone? (#48)
            return result

    return FastAgent


def _draining_check(state_dir: Path | None) -> Callable[[], str]:
    if state_dir is None:
        return lambda: ""
    from sentinel.migration import leaving_reason

    return lambda: leaving_reason(state_dir)


class _NoAgentTraceback(logging.Filter):
    """torch logs every worker exit with ``logger.exception``: a traceback through the agent's
    own polling code (the worker's error is in its error file and its own stderr). Formatting it
    took 1.3-2.7 s of a loaded 2-core host — between a worker's exit and its agent's restart,
    on every survivor of every migration. The message (exit code, pid, local rank) stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "failed (exitcode" in str(record.msg):
            record.exc_info = None
            record.exc_text = None
        return True


class _Signals:
    """Signals before the admission: SIGUSR1 admits, SIGTERM/SIGINT/SIGHUP stop. A wakeup fd makes
    the wait return at once (no polling interval on the admission)."""

    def __init__(self) -> None:
        self.got: list[str] = []
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)
        os.set_blocking(self.r, False)
        self.previous_fd = signal.set_wakeup_fd(self.w, warn_on_full_buffer=False)
        signal.signal(signal.SIGUSR1, lambda *_: self.got.append("admit"))
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, _f: self.got.append(signal.Signals(signum).name))

    def wait(self, timeout: float) -> None:
        select.select([self.r], [], [], timeout)
        try:
            while os.read(self.r, 512):
                pass
        except BlockingIOError:
            pass

    def running(self) -> None:
        """From now on torch's handling: SIGTERM/SIGINT/SIGHUP raise SignalException in the main
        thread (the agent then leaves and stops its workers); a second SIGUSR1 does nothing."""
        from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.r)
        os.close(self.w)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _terminate_process_handler)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: python -m trainer.elastic [options] -- <torchrun arguments>  (see --help)")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m trainer.elastic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", action="store_true", default=os.environ.get("SENTINEL_WARM") == "1",
                    help="start everything, then wait outside the rendezvous for SIGUSR1 (default: $SENTINEL_WARM=1)")
    ap.add_argument("--preload", action="append", default=[], metavar="MODULE",
                    help="import MODULE in the forkserver (repeatable; only modules without import side effects)")
    ap.add_argument("--state-dir", type=Path, default=os.environ.get("SENTINEL_STATE_DIR") or None,
                    help="Sentinel's state directory: a node being drained there never re-joins (default: $SENTINEL_STATE_DIR)")
    ap.add_argument("--ready-file", type=Path, help="written once the agent is warm (torch imported, forkserver up)")
    ap.add_argument("--rdzv-poll-seconds", type=float, default=DEFAULT_POLL_SECONDS,
                    help=f"rendezvous poll interval while joining (torch: 1 s; default {DEFAULT_POLL_SECONDS})")
    ours = ap.parse_args(argv[:cut])
    if not 0.005 <= ours.rdzv_poll_seconds <= 5:
        ap.error("--rdzv-poll-seconds must be between 0.005 and 5")
    return ours, argv[cut + 1:]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signals = _Signals()  # first: an early SIGUSR1 must not kill the agent (its default action)
    ours, torchrun_argv = parse(argv)
    logging.basicConfig(level=logging.INFO, format="[sentinel.elastic] %(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    t0 = time.monotonic()

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.launcher.api import _get_addr_and_port

    from trainer import forkserver, slot_rendezvous

    slot_rendezvous.register()  # --rdzv-backend sentinel
    targs = torchrun.parse_args(torchrun_argv)
    if targs.rdzv_backend == "sentinel-etcd":  # needs etcd3gw (the etcd extra): only then
        importlib.import_module("trainer.etcd_rendezvous").register()
    if targs.standalone or targs.rdzv_backend == "static":
        print("trainer.elastic: needs a shared rendezvous (--rdzv-backend sentinel, c10d or etcd-v2 with --rdzv-endpoint)",
              file=sys.stderr)
        return 2
    if targs.master_port is None:
        targs.master_port = 29500
    config, _cmd, _cmd_args = torchrun.config_from_args(targs)
    if targs.no_python:
        print("trainer.elastic: --no-python is not supported (workers are forks of a Python forkserver)", file=sys.stderr)
        return 2
    entrypoint: Callable[..., None] = run_module if targs.module else run_script
    args = [targs.training_script, *targs.training_script_args]
    if targs.start_method not in ("spawn", "forkserver"):
        log.warning("--start-method %s ignored: workers start from the preloaded forkserver", targs.start_method)
    config.start_method = "forkserver"
    preload = ["torch", "torch.distributed", "trainer.warmup", *ours.preload]
    for name in ours.preload:
        if importlib.util.find_spec(name) is None:
            print(f"trainer.elastic: --preload {name}: no such module", file=sys.stderr)
            return 2
    how = forkserver.start(preload)
    log.info("forkserver up (%s) with %s preloaded in %.2f s", how, ", ".join(preload), time.monotonic() - t0)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoAgentTraceback())

    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    rdzv = Rendezvous(rdzv_registry.get_rendezvous_handler(params), ours.rdzv_poll_seconds)
    for problem in rdzv.problems:
        log.warning("%s", problem)
    deadline = store_deadline.for_agent(config, rdzv.handler)

    # built before a warm spare waits: on its admission only the rendezvous is left (0.1-0.2 s here, #48)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=rdzv.handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, master_addr=master_addr, master_port=master_port,
                      local_addr=config.local_addr)
    agent = _make_agent_class()(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                                log_line_prefix_template=config.log_line_prefix_template,
                                shutdown_timeout=config.shutdown_timeout,
                                rendezvous=rdzv, draining=_draining_check(ours.state_dir))
    if not _wait_admitted(ours, rdzv, signals, t0):
        return 0
    signals.running()

    return _run_agent(agent, rdzv, endpoint=config.rdzv_endpoint, deadline=deadline)


def _wait_admitted(ours: argparse.Namespace, rdzv: Rendezvous, signals: "_Signals", t0: float) -> bool:
    """A warm spare waits outside the rendezvous for SIGUSR1 (``sentinel admit``); False when a
    stop signal came first (the agent exits 0 without joining)."""
    if ours.warm:
        rdzv.sync()
        if ours.ready_file:
            from sentinel.fsutil import write_json_atomic

            write_json_atomic(ours.ready_file, {"pid": os.getpid(), "time": time.time(),
                                                "warm_seconds": round(time.monotonic() - t0, 3)})
        log.info("warm spare ready in %.2f s; waiting outside the rendezvous for SIGUSR1", time.monotonic() - t0)
        watch = getattr(rdzv.handler, "watch_silence", None)  # the slot rendezvous's silence rule (#41)
        while not signals.got:
            signals.wait(WARM_WAIT_BEAT if watch is None else watch())
        log.info("admitted: joining the rendezvous")
    stops = [g for g in signals.got if g != "admit"]
    if stops:
        log.info("stopped (%s) before joining the rendezvous", stops[0])
        return False
    return True


def _run_agent(agent: Any, rdzv: Rendezvous, *, endpoint: str = "", deadline: Any = None) -> int:
    """Run the agent to its end; the exit status, with one line on stderr saying why it ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                          RendezvousGracefulExitError)

    close_rendezvous = True
    try:
        result = agent.run()
        if result is None:  # the rendezvous let this node go (torch's run() swallows the graceful exit)
            close_rendezvous = False  # the job goes on without this node
            fenced = getattr(rdzv.handler, "fenced", [])
            print(f"trainer.elastic: left the job: {getattr(agent, 'graceful_exit', '') or 'the rendezvous ended'}"
                  + (f"; fenced writes refused: {', '.join(fenced)}" if fenced else ""), file=sys.stderr)
            return 0
        if result.is_failed():
            for rank, failure in sorted(result.failures.items()):
                print(f"trainer.elastic: rank {rank} failed: exit {failure.exitcode}", file=sys.stderr)
            return 1
        return 0
    except NodeLeaving as exc:
        close_rendezvous = False
        print(f"trainer.elastic: left the job: {exc}", file=sys.stderr)
        return 0
    except SignalException as exc:
        close_rendezvous = False  # as torch: closing would end the rendezvous for every node
        print(f"trainer.elastic: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except (RendezvousClosedError, RendezvousGracefulExitError) as exc:
        close_rendezvous = False
        print(f"trainer.elastic: the rendezvous is closed: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except RendezvousConnectionError as exc:
        # the store's host is gone (or cut off): a single c10d store has no replica, so no agent can
        # learn the next membership; say it once, plainly, instead of torch's traceback
        close_rendezvous = False
        cause = exc.__cause__ or exc
        why = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no detail'}"
        if deadline is None or not deadline.lost_why:  # else said (and the daemon told) when it was lost
            print(f"trainer.elastic: the rendezvous store {endpoint or '(endpoint unknown)'} cannot be reached "
                  f"({why}): this job cannot continue without it", file=sys.stderr)
            store_deadline.tell_daemon(endpoint or "(endpoint unknown)", why)
        return 1
    finally:
        if close_rendezvous:
            rdzv.handler.shutdown()


def exit_now(code: int) -> None:
    """End the agent process once its work is done: flush what it wrote, then ``os._exit``. The
    interpreter's own teardown of a process that imported torch, the training module and torch's
    elastic agent cost 0.7-0.9 CPU seconds here (measured: 2.6 vs 3.3 CPU-s for import + exit),
    spent after the agent has stopped its workers and left the rendezvous: on a drained node it
    is CPU the node's remaining work (and, in a one-host drill, the spare) does not get. Nothing
    is lost by skipping it: the workers are stopped, the forkserver and the heartbeat thread end
    with this process, and the log handlers are flushed and closed here."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    exit_now(main())
