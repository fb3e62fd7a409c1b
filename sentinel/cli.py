"""The ``sentinel`` command."""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

from sentinel import config as config_mod

log = logging.getLogger("sentinel.cli")

NO_NVML = (
    "the NVML package is missing ({detail}); on a machine without NVIDIA GPUs, simulate them: "
    "`sentinel simulate init /tmp/gpus.json --gpus 8` then `sentinel run --simulate /tmp/gpus.json`"
)


def fail(message: str, code: int = 2) -> int:
    print(f"sentinel: {message}", file=sys.stderr)
    return code


DEFAULT_CONFIG = "/etc/sentinel/sentinel.toml"  # what `sentinel install` writes and the units read


def load_config(path: str | None) -> config_mod.Config:
    """The config at ``path`` (built-in defaults without one). A file that is not there is the
    usual first-run mistake: the error says how to create it."""
    if not path:
        return config_mod.Config()
    try:
        return config_mod.load(path)
    except config_mod.ConfigError as exc:
        if not os.path.lexists(path):
            hint = ("`sentinel install` writes it (the default config, the units and the directories)"
                    if os.path.abspath(path) == DEFAULT_CONFIG else
                    f"create it, or run `sentinel install` for the default one at {DEFAULT_CONFIG}")
            raise config_mod.ConfigError(f"{exc}; {hint}") from None
        raise


def with_overrides(cfg: config_mod.Config, args: argparse.Namespace) -> config_mod.Config:
    daemon, metrics = cfg.daemon, cfg.metrics
    if getattr(args, "runtime_dir", None):
        daemon = dataclasses.replace(daemon, runtime_dir=args.runtime_dir)
    if getattr(args, "state_dir", None):
        daemon = dataclasses.replace(daemon, state_dir=args.state_dir)
    if getattr(args, "node_name", None):
        daemon = dataclasses.replace(daemon, node_name=args.node_name)
    if getattr(args, "port", None) is not None:
        metrics = dataclasses.replace(metrics, port=args.port)
    if getattr(args, "listen_address", None):
        metrics = dataclasses.replace(metrics, listen_address=args.listen_address)
    cfg = dataclasses.replace(cfg, daemon=daemon, metrics=metrics)
    if getattr(args, "no_kernel_log", False):
        cfg = dataclasses.replace(cfg, ebpf=dataclasses.replace(cfg.ebpf, enabled=False, kmsg_fallback=False))
    cfg.validate()  # the overrides too: --port 70000 is as wrong as port = 70000
    return cfg


# -- run -----------------------------------------------------------------------------------------
class AlreadyRunning(RuntimeError):
    """Another daemon holds the runtime directory's lock; ``pid`` is its pid when it wrote one."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(pid)
        self.pid = pid


def lock_runtime_dir(runtime_dir: Path) -> int:
    """Make this process the only daemon on ``runtime_dir``: an exclusive ``flock`` on
    ``<runtime_dir>/daemon.lock``, held by the returned descriptor until the process exits
    (it is never closed; ``O_CLOEXEC`` keeps commands the daemon runs from inheriting it).

    A second daemon must touch nothing of the first one's (its ``daemon.sock``, its
    ``status.json``), so this runs before anything is bound or written. Raises
    :class:`AlreadyRunning` when the lock is held, ``UnsafePath`` when the lock file is a symlink,
    not a regular file, has other links, or belongs to someone other than root or this uid, and
    ``OSError`` when it cannot be opened.
    """
    from sentinel.fsutil import UnsafePath, open_trusted

    path = runtime_dir / "daemon.lock"
    try:
        # a hard link to another file would have this daemon truncate that file with its pid
        fd = open_trusted(path, os.O_RDWR | os.O_CREAT, mode=0o600, owners=frozenset({0, os.geteuid()}),
                          single_link=True)
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}; remove it") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _pid_in(os.pread(fd, 32, 0))
        os.close(fd)
        raise AlreadyRunning(pid) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _pid_in(data: bytes) -> int | None:
    text = data.decode("ascii", "replace").strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None


class SignalRelay:
    """Acts on signals outside signal context.

    A Python signal handler runs in the main thread between two bytecodes, possibly while that
    thread is inside ``threading.Event.wait`` holding the Event's lock: a handler that calls
    ``Event.set`` then deadlocks on it, and every later SIGTERM queues behind it. So the Python
    handlers here do nothing at all; the interpreter's C-level handler has already written the
    signal number to a wakeup socket (``signal.set_wakeup_fd``), and a thread reading that socket
    runs the action (``Daemon.stop``, setting the reload flag) like any other thread would.
    Signals of one kind that arrive together may be handled once (as the kernel does anyway).
    """

    _CLOSE = b"\0"  # not a signal number: tells the thread to exit

    def __init__(self, actions: dict[int, Callable[[], None]]) -> None:
        self.actions = actions
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._thread = threading.Thread(target=self._relay, name="sentinel-signals", daemon=True)
        self._previous: dict[int, object] = {}
        self._previous_fd = -1

    def install(self) -> None:
        """Main thread only (a ``signal`` module rule)."""
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in self.actions:
            self._previous[signum] = signal.signal(signum, _ignore_in_handler)

    def close(self) -> None:
        """Restore the previous handlers and stop the thread. Main thread only."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._previous_fd)
        try:
            self._writer.send(self._CLOSE)
        except OSError:
            pass  # the buffer is full of signal numbers; the thread is a daemon thread and exits with us
        self._thread.join(timeout=2)
        self._writer.close()

    def _relay(self) -> None:
        while True:
            data = self._reader.recv(512)
            if not data or self._CLOSE[0] in data:
                self._reader.close()
                return
            for signum in dict.fromkeys(data):  # each signal once per wakeup, in arrival order
                action = self.actions.get(signum)
                if action is not None:
                    action()


def _ignore_in_handler(signum: int, frame: object) -> None:
    """Installed for the relayed signals: the work happens in SignalRelay's thread."""


def _reloader(daemon, args: argparse.Namespace, reload_flag: threading.Event) -> Callable[[], config_mod.Config | None]:
    """The loop's reload hook: after SIGHUP (``reload_flag``), the configuration to apply, or None."""
    from sentinel.log import event

    def reload() -> config_mod.Config | None:
        """Called by the loop between polls: the configuration to apply now, or None."""
        if not reload_flag.is_set():
            return None
        reload_flag.clear()
        daemon.notifier.reloading()
        try:
            new = with_overrides(load_config(args.config), args)
        except config_mod.ConfigError as exc:
            daemon.reloads["rejected"] += 1
            event(log, "config reload rejected, keeping the old config", logging.ERROR, reload_outcome="rejected",
                  config=args.config, error=str(exc))
            daemon.notifier.ready(daemon.summary())
            return None
        applied, restart = config_mod.reload_plan(daemon.config, new)
        # Exclusive outcomes: "ok" (everything applied), "partial" (some changes wait for a
        # restart), "rejected" (invalid file; the old config stays).
        daemon.reloads["partial" if restart else "ok"] += 1
        logging.getLogger("sentinel").setLevel(new.daemon.log_level.upper())
        event(log, "config reload", logging.WARNING if restart else logging.INFO,
              reload_outcome="partial" if restart else "ok", config=args.config, applied=applied,
              needs_restart=restart)
        daemon.notifier.ready(daemon.summary())
        # what the daemon runs with: a later reload reports the pending restart again
        return config_mod.live_part(daemon.config, new)

    return reload


def cmd_run(args: argparse.Namespace) -> int:
    from sentinel import log as logsetup
    from sentinel.builder import build_daemon
    from sentinel.daemon import StartupError
    from sentinel.fsutil import UnsafePath, ensure_private_dir
    from sentinel.sources.nvml import NvmlUnavailable

    try:
        cfg = with_overrides(load_config(args.config), args)
    except config_mod.ConfigError as exc:
        return fail(f"refusing to start: {exc}")
    logsetup.setup(cfg.daemon.log_level)
    runtime = Path(cfg.daemon.runtime_dir)
    try:
        ensure_private_dir(runtime, "runtime directory", mode=0o755)
        lock_fd = lock_runtime_dir(runtime)  # noqa: F841 - held, never closed, for the process's life
    except AlreadyRunning as exc:
        who = f"pid {exc.pid}" if exc.pid else "pid unknown"
        return fail(f"another sentinel daemon ({who}) is running on runtime directory {runtime}; "
                    f"stop it first or give this one another --runtime-dir")
    except UnsafePath as exc:
        return fail(f"refusing to start: {exc}")
    except OSError as exc:
        return fail(f"runtime directory {runtime} is not writable: {exc.strerror}")
    if args.simulate:
        from sentinel.sources import simulated

        try:
            simulated.load_state(args.simulate)
        except simulated.SimulatedStateError as exc:
            return fail(str(exc))
    try:
        daemon = build_daemon(cfg, simulate=args.simulate, no_ebpf=args.no_ebpf)
    except NvmlUnavailable as exc:
        return fail(NO_NVML.format(detail=exc))
    except StartupError as exc:
        return fail(str(exc))

    reload_flag = threading.Event()
    relay = SignalRelay({signal.SIGTERM: daemon.stop, signal.SIGINT: daemon.stop, signal.SIGHUP: reload_flag.set})
    relay.install()

    reload = _reloader(daemon, args, reload_flag)

    try:
        try:
            daemon.start()  # NVML that cannot start is a reading (source down, retried), not an exit
        except StartupError as exc:
            return fail(str(exc))
        daemon.run(reload)
    finally:
        daemon.close()
        relay.close()
    return 0


# -- check-config --------------------------------------------------------------------------------
def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        load_config(args.file)
    except config_mod.ConfigError as exc:
        return fail(str(exc))
    print(f"{args.file}: ok")
    return 0


# -- simulate / inject -----------------------------------------------------------------------------
def cmd_simulate_init(args: argparse.Namespace) -> int:
    from sentinel.sources import simulated

    try:
        state = simulated.healthy_state(args.gpus)
        simulated.write_state(args.state, state)
    except (simulated.SimulatedStateError, OSError) as exc:
        return fail(str(exc))
    print(f"{args.state}: {args.gpus} healthy simulated GPUs")
    return 0


def cmd_inject(args: argparse.Namespace) -> int:
    from sentinel.sources import simulated

    try:
        simulated.inject(args.state, args.gpu, args.fault)
    except simulated.SimulatedStateError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{args.state}: {exc.strerror}")
    print(f"GPU {args.gpu}: {' '.join(args.fault)}")
    return 0


# -- status ------------------------------------------------------------------------------------------
def cmd_drill(args: argparse.Namespace) -> int:
    """`sentinel drill`: the local drill, or with --scheduler slurm the one through a real Slurm cluster."""
    if args.scheduler == "slurm":
        from sentinel_tools.drill_slurm import run_slurm_drill

        return run_slurm_drill(args)
    from sentinel_tools.drill import run_drill

    return run_drill(args)


def cmd_status(args: argparse.Namespace) -> int:
    from sentinel.fsutil import UnsafePath, read_trusted

    path = Path(args.runtime_dir) / "status.json"
    try:  # the daemon's (root's) own file: the healthcheck acts on it as root
        status = json.loads(read_trusted(path, owners=frozenset({0, os.geteuid()}), max_bytes=1 << 22))
    except FileNotFoundError:
        return fail(f"no running daemon: {path} does not exist")
    except UnsafePath as exc:
        return fail(f"not trusting {path}: {exc}")
    except (OSError, ValueError) as exc:
        return fail(f"cannot read {path}: {exc}")
    if not isinstance(status, dict) or not isinstance(status.get("gpus"), list):
        return fail(f"cannot read {path}: not a status written by the daemon")
    pid = status.get("pid")
    try:
        if pid:
            os.kill(int(pid), 0)
    except ProcessLookupError:
        return fail(f"no running daemon: pid {pid} from {path} has exited")
    except PermissionError:
        pass  # alive, owned by another user
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print(f"node {status['node']}  driver {status['driver_version']}  metrics :{status['metrics_port']}")
        print(f"{'GPU':>3}  {'health':<18} {'bus id':<13} {'temp':>5} {'ecc sbe/dbe':>12} {'retired':>8} {'remap':>6} {'xids':<10} forecast")
        for g in status["gpus"]:
            v = g["values"]
            health = g["health"] + (" (lost)" if g["lost"] else "") + (" (hung)" if g["hung"] else "")

            def num(*keys: str) -> str:
                vals = [v.get(k) for k in keys]
                return "/".join("-" if x is None else f"{x:g}" for x in vals)

            xids = ",".join(f"{k}x{n}" for k, n in g["xid_counts"].items()) or "-"
            fc = "-" if g["forecast_seconds"] is None else f"{g['forecast_seconds']:.0f}s"
            print(f"{g['index']:>3}  {health:<18} {g['pci_bus_id']:<13} {num('temperature_celsius'):>5} "
                  f"{num('ecc_corrected_volatile', 'ecc_uncorrected_volatile'):>12} "
                  f"{num('retired_pages_sbe', 'retired_pages_dbe'):>8} {num('remapped_rows_uncorrectable'):>6} {xids:<10} {fc}")
        from sentinel import jobhealth, rdzv_store

        for line in jobhealth.status_lines(status.get("job") or {}) + rdzv_store.status_lines(status.get("rendezvous_store")):
            print(line)
    unhealthy = [g for g in status["gpus"] if g["health"] != "healthy" or g["lost"] or g["hung"]]
    if status.get("nvml_error"):  # blind to the GPUs is never healthy (--json: the "nvml_error" field)
        if not args.json:
            print(f"NVML unavailable, the GPUs are not watched: {status['nvml_error']}", file=sys.stderr)
        return 1
    return 1 if unhealthy else 0


def cmd_uncordon(args: argparse.Namespace) -> int:
    """Undo Sentinel's cordon through the configured backend: only what Sentinel added (its
    Slurm drain, its taint and condition), never an admin's; then the local marker."""
    import time

    from sentinel.backends import make_backend
    from sentinel.backends.base import BackendContext, BackendError

    try:
        cfg = with_overrides(load_config(args.config), args)
    except config_mod.ConfigError as exc:
        return fail(str(exc))
    node = cfg.daemon.node_name or socket.gethostname()
    ctx = BackendContext(node=node, state_dir=Path(cfg.daemon.state_dir), runtime_dir=Path(cfg.daemon.runtime_dir),
                         timeout=cfg.actions.command_timeout_seconds, wall=time.time)
    try:
        said = make_backend(cfg.actions, ctx).uncordon()
    except BackendError as exc:
        return fail(f"uncordon {node} ({cfg.actions.backend} backend): {exc}", 1)
    print(said)
    return 0


def cmd_topology(args: argparse.Namespace) -> int:
    """Print the topology the daemon would use and the spare it would choose (sentinel.topology.show)."""
    from sentinel.topology.show import run

    try:
        cfg = load_config(args.config)
    except config_mod.ConfigError as exc:
        return fail(str(exc))
    return run(args, cfg, node=args.node_name or cfg.daemon.node_name or socket.gethostname(), fail=fail)


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the torchrun agent under an identity record the daemon trusts (see sentinel.launch)."""
    from sentinel.launch import launch

    command = args.command[1:] if args.command and args.command[0] == "--" else args.command
    return launch(command, Path(args.pidfile), Path(args.state_dir), user=args.user, warm=args.warm)


def cmd_admit(args: argparse.Namespace) -> int:
    """Admit a warm spare: its agent joins the rendezvous now (see sentinel.launch.admit)."""
    from sentinel.launch import admit

    return admit(Path(args.pidfile))


def cmd_install(args: argparse.Namespace) -> int:
    from sentinel.install import InstallError, default_bin, install

    try:
        sentinel_bin = args.bin or default_bin()
        return install(Path(os.path.abspath(args.root)), sentinel_bin, reload_systemd=not args.no_reload)
    except InstallError as exc:
        return fail(str(exc))


TOOLS = ("simulate", "inject", "drill")  # their modules (simulator, goodput Monte Carlo, drill harness) load lazily


def _add_daemon_commands(sub: argparse._SubParsersAction) -> None:
    """run, check-config."""
    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", help="TOML config (default: built-in defaults, as in systemd/sentinel.toml)")
    run.add_argument("--simulate", metavar="STATE", help="use simulated GPUs from this state file instead of NVML")
    run.add_argument("--runtime-dir", help="override daemon.runtime_dir")
    run.add_argument("--state-dir", help="override daemon.state_dir")
    run.add_argument("--node-name", help="override daemon.node_name")
    run.add_argument("--port", type=int, help="override metrics.port (0 = any free port)")
    run.add_argument("--listen-address", help="override metrics.listen_address")
    run.add_argument("--no-ebpf", action="store_true", help="do not load eBPF probes (kernel log fallback only)")
    run.add_argument("--no-kernel-log", action="store_true",
                     help="read neither eBPF nor /dev/kmsg (a --simulate daemon beside others on a shared host "
                          "must not act on the host's kernel lines)")
    run.set_defaults(func=cmd_run)

    cc = sub.add_parser("check-config", help="validate a config file")
    cc.add_argument("file")
    cc.set_defaults(func=cmd_check_config)


def _add_tool_commands(sub: argparse._SubParsersAction, wanted: Callable[[str], bool]) -> None:
    """simulate, inject, status, drill: a tool's module is imported only when ``wanted``."""
    sim = sub.add_parser("simulate", help="simulated GPUs and fleet simulations")
    simsub = sim.add_subparsers(dest="simulate_command", required=True)
    init = simsub.add_parser("init", help="write a healthy simulated GPU state file")
    init.add_argument("state")
    init.add_argument("--gpus", type=int, default=8)
    init.set_defaults(func=cmd_simulate_init)
    gp = simsub.add_parser("goodput", help="Monte Carlo of ETTR at scale from measured figures (--measured): periodic, async, "
                           "Sentinel, + memory tier, + warm spare; intervals searched; spares; sensitivity")
    if wanted("simulate"):
        from sentinel_tools.sim import goodput

        goodput.add_arguments(gp)
        gp.set_defaults(func=goodput.main_args)
    pl = simsub.add_parser("placement", help="what placement costs at scale: bytes per network tier and step time for "
                           "FSDP with a near or far spare, ETTR, and replicas in the same or another rack")
    if wanted("simulate"):
        from sentinel_tools.sim import placement

        placement.add_arguments(pl)
        pl.set_defaults(func=placement.main_args)

    faults = ""
    if wanted("inject"):
        from sentinel.sources import simulated

        faults = "faults: " + "; ".join(f"{k}: {v}" for k, v in simulated.FAULTS.items())
    inj = sub.add_parser("inject", help="inject faults into a simulated GPU", epilog=faults)
    inj.add_argument("state")
    inj.add_argument("--gpu", type=int, required=True)
    inj.add_argument("fault", nargs="+", help="e.g. ecc-dbe=+1 xid=79 hang temp=95")
    inj.set_defaults(func=cmd_inject)

    st = sub.add_parser("status", help="health of each GPU from the running daemon; exit 1 if any is unhealthy")
    st.add_argument("--runtime-dir", default=os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"))
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    dr_help = "end-to-end drill on this machine: N nodes + spares, a fault, a migration"
    if wanted("drill"):
        from sentinel_tools import drill

        dr = sub.add_parser("drill", help=dr_help, epilog="faults: " + "; ".join(f"{k}: {v}" for k, v in drill.FAULTS.items()))
        drill.add_arguments(dr)
        dr.set_defaults(func=cmd_drill)
    else:
        sub.add_parser("drill", help=dr_help)


def _add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """uncordon, install."""
    un = sub.add_parser("uncordon", help="operator: undo Sentinel's cordon of this node (its drain/taint/condition and "
                        "marker; never an admin's)")
    un.add_argument("--config", help="TOML config naming the backend (default: built-in defaults, backend = file)")
    un.add_argument("--state-dir", help="override daemon.state_dir")
    un.add_argument("--node-name", help="override daemon.node_name (the scheduler's name for this node)")
    un.set_defaults(func=cmd_uncordon)

    ins = sub.add_parser("install", help="put the systemd units, the default config and the directories in place "
                         "(idempotent; never overwrites a changed config)")
    ins.add_argument("--root", default="/", help="install into this tree instead of / (an image, a staging root)")
    ins.add_argument("--bin", help="the sentinel command the units run (default: this one)")
    ins.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    ins.set_defaults(func=cmd_install)


def _add_node_commands(sub: argparse._SubParsersAction, wanted: Callable[[str], bool]) -> None:
    """scan, explain, launch, admit."""
    sc = sub.add_parser("scan", help="one-shot check of this node: NVML and the kernel log; Nagios exit codes "
                        "(0 ok, 1 warning, 2 critical, 3 unknown)")
    ex = sub.add_parser("explain", help="what an Xid means and what Sentinel does about it")
    ex.add_argument("xid", help="an Xid number, e.g. 79")
    ex.add_argument("--config", help="TOML config whose [policy] Xid overrides apply")
    if wanted("scan") or wanted("explain"):
        from sentinel import scan

        scan.add_arguments(sc)
        sc.set_defaults(func=scan.run)
        ex.set_defaults(func=scan.explain)

    tp = sub.add_parser("topology", help="print the topology Sentinel reads (file, scheduler) and the spare it would "
                        "choose; exit 1 naming the source and node of a contradiction (docs/topology.md)")
    tp.add_argument("--config", help="TOML config: [actions.topology] and the backend whose topology is read")
    tp.add_argument("--file", action="append", default=[], help="also read this topology file (repeatable)")
    tp.add_argument("--node-name", help="this node (default: daemon.node_name, else the host name)")
    tp.add_argument("--for", dest="departed", help="the departed node (default: this node)")
    tp.add_argument("--spares", help="comma-separated waiting spares: print the one Sentinel would choose")
    tp.set_defaults(func=cmd_topology)

    la = sub.add_parser("launch", help="run the torchrun agent under a pidfile the daemon drains (refuses on a cordoned node)")
    la.add_argument("--pidfile", default=os.path.join(os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"), "agent.pid"))
    la.add_argument("--state-dir", default="/var/lib/sentinel")
    la.add_argument("--user", default=os.environ.get("SENTINEL_AGENT_USER", ""),
                    help="run the agent (the training job) as this user; the launcher stays root "
                         "(default: $SENTINEL_AGENT_USER, else the launcher's own user)")
    la.add_argument("--warm", action="store_true",
                    help="a warm spare: the agent starts but joins the rendezvous only on `sentinel admit`")
    la.add_argument("command", nargs=argparse.REMAINDER)
    la.set_defaults(func=cmd_launch)

    ad = sub.add_parser("admit", help="let a warm spare's agent (sentinel launch --warm) join the rendezvous")
    ad.add_argument("--pidfile", default=os.path.join(os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"), "agent.pid"))
    ad.set_defaults(func=cmd_admit)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or (``only`` = the command being run) one that imports nothing the
    other commands need: ``sentinel run`` never loads the drill harness or the simulators."""

    def wanted(name: str) -> bool:
        return only is None or only == name

    from sentinel import __version__

    p = argparse.ArgumentParser(prog="sentinel", description="GPU failure prediction, snapshot and spare migration daemon")
    p.add_argument("--version", action="version", version=f"sentinel {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    _add_daemon_commands(sub)
    _add_tool_commands(sub, wanted)
    _add_operator_commands(sub)
    _add_node_commands(sub, wanted)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None and argv[:1] == ["--version"]:
        command = "--version"  # the light parser: nothing but the version is needed
    parser = build_parser(command if command in ("run", "check-config", "status", "uncordon", "launch", "admit", "install",
                                                  "scan", "explain", "topology", "--version", *TOOLS) else None)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `sentinel ... | head`: the reader left before the output ended
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not raise again
        except (OSError, ValueError):
            pass
        return fail(f"{args.command}: the output was closed before it ended (broken pipe)", 1)
    except PermissionError as exc:
        where = f" on {exc.filename}" if exc.filename else ""
        hint = f"; run it as root (sudo sentinel {args.command} ...)" if os.geteuid() != 0 else ""
        return fail(f"{args.command}: permission denied{where} ({exc.strerror or exc}){hint}", 1)


if __name__ == "__main__":
    sys.exit(main())
