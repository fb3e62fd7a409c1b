"""The ``sentinel`` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from sentinel import config as config_mod
from sentinel.sources import simulated

log = logging.getLogger("sentinel.cli")

NO_NVML = (
    "NVML was not found ({detail}); on a machine without NVIDIA GPUs, simulate them: "
    "`sentinel simulate init /tmp/gpus.json --gpus 8` then `sentinel run --simulate /tmp/gpus.json`"
)


def fail(message: str, code: int = 2) -> int:
    print(f"sentinel: {message}", file=sys.stderr)
    return code


def load_config(path: str | None) -> config_mod.Config:
    return config_mod.load(path) if path else config_mod.Config()


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
    return dataclasses.replace(cfg, daemon=daemon, metrics=metrics)


# -- run -----------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from sentinel import log as logsetup
    from sentinel.builder import build_daemon
    from sentinel.daemon import StartupError
    from sentinel.sources.nvml import NvmlUnavailable

    try:
        cfg = with_overrides(load_config(args.config), args)
    except config_mod.ConfigError as exc:
        return fail(f"refusing to start: {exc}")
    logsetup.setup(cfg.daemon.log_level)
    if args.simulate:
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
    signal.signal(signal.SIGTERM, lambda *_: daemon.stop())
    signal.signal(signal.SIGINT, lambda *_: daemon.stop())
    signal.signal(signal.SIGHUP, lambda *_: reload_flag.set())

    def reload() -> config_mod.Config | None:
        if not reload_flag.is_set():
            return None
        reload_flag.clear()
        daemon.notifier.reloading()
        try:
            new = with_overrides(load_config(args.config), args)
        except config_mod.ConfigError as exc:
            daemon.reloads["rejected"] += 1
            log.error("config reload rejected, keeping the old config: %s", exc, extra={"fields": {"event": "reload_rejected"}})
            daemon.notifier.ready(daemon.summary())
            return None
        daemon.notifier.ready(daemon.summary())
        return new

    try:
        try:
            daemon.start()
        except NvmlUnavailable as exc:
            return fail(NO_NVML.format(detail=exc))
        except StartupError as exc:
            return fail(str(exc))
        daemon.run(reload)
    finally:
        daemon.close()
    return 0


# -- check-config --------------------------------------------------------------------------------
def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config_mod.load(args.file)
    except config_mod.ConfigError as exc:
        return fail(str(exc))
    print(f"{args.file}: ok")
    return 0


# -- simulate / inject -----------------------------------------------------------------------------
def cmd_simulate_init(args: argparse.Namespace) -> int:
    try:
        state = simulated.healthy_state(args.gpus)
        simulated.write_state(args.state, state)
    except (simulated.SimulatedStateError, OSError) as exc:
        return fail(str(exc))
    print(f"{args.state}: {args.gpus} healthy simulated GPUs")
    return 0


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        simulated.inject(args.state, args.gpu, args.fault)
    except simulated.SimulatedStateError as exc:
        return fail(str(exc))
    except OSError as exc:
        return fail(f"{args.state}: {exc.strerror}")
    print(f"GPU {args.gpu}: {' '.join(args.fault)}")
    return 0


# -- status ------------------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    path = Path(args.runtime_dir) / "status.json"
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        return fail(f"no running daemon: {path} does not exist")
    except (OSError, json.JSONDecodeError) as exc:
        return fail(f"cannot read {path}: {exc}")
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
    unhealthy = [g for g in status["gpus"] if g["health"] != "healthy" or g["lost"] or g["hung"]]
    return 1 if unhealthy else 0


def cmd_uncordon(args: argparse.Namespace) -> int:
    from sentinel.migration import uncordon

    state = Path(args.state_dir)
    if uncordon(state):
        print(f"{state}: cordon cleared; the agent may start again")
        return 0
    print(f"{state}: not cordoned")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    """Run the torchrun agent under an identity record the daemon trusts (see sentinel.launch)."""
    from sentinel.launch import launch

    command = args.command[1:] if args.command and args.command[0] == "--" else args.command
    return launch(command, Path(args.pidfile), Path(args.state_dir))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sentinel", description="GPU failure prediction, snapshot and spare migration daemon")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", help="TOML config (default: built-in defaults, as in systemd/sentinel.toml)")
    run.add_argument("--simulate", metavar="STATE", help="use simulated GPUs from this state file instead of NVML")
    run.add_argument("--runtime-dir", help="override daemon.runtime_dir")
    run.add_argument("--state-dir", help="override daemon.state_dir")
    run.add_argument("--node-name", help="override daemon.node_name")
    run.add_argument("--port", type=int, help="override metrics.port (0 = any free port)")
    run.add_argument("--listen-address", help="override metrics.listen_address")
    run.add_argument("--no-ebpf", action="store_true", help="do not load eBPF probes (kernel log fallback only)")
    run.set_defaults(func=cmd_run)

    cc = sub.add_parser("check-config", help="validate a config file")
    cc.add_argument("file")
    cc.set_defaults(func=cmd_check_config)

    sim = sub.add_parser("simulate", help="simulated GPUs and fleet simulations")
    simsub = sim.add_subparsers(dest="simulate_command", required=True)
    init = simsub.add_parser("init", help="write a healthy simulated GPU state file")
    init.add_argument("state")
    init.add_argument("--gpus", type=int, default=8)
    init.set_defaults(func=cmd_simulate_init)
    from sentinel.sim import goodput

    gp = simsub.add_parser("goodput", help="Monte Carlo of ETTR at scale: periodic vs async vs Sentinel, spare pool sizing")
    goodput.add_arguments(gp)
    gp.set_defaults(func=goodput.main_args)

    inj = sub.add_parser("inject", help="inject faults into a simulated GPU",
                         epilog="faults: " + "; ".join(f"{k}: {v}" for k, v in simulated.FAULTS.items()))
    inj.add_argument("state")
    inj.add_argument("--gpu", type=int, required=True)
    inj.add_argument("fault", nargs="+", help="e.g. ecc-dbe=+1 xid=79 hang temp=95")
    inj.set_defaults(func=cmd_inject)

    st = sub.add_parser("status", help="health of each GPU from the running daemon; exit 1 if any is unhealthy")
    st.add_argument("--runtime-dir", default=os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"))
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    from sentinel import drill

    dr = sub.add_parser("drill", help="end-to-end drill on this machine: N nodes + spares, a fault, a migration",
                        epilog="faults: " + "; ".join(f"{k}: {v}" for k, v in drill.FAULTS.items()))
    drill.add_arguments(dr)
    dr.set_defaults(func=drill.run_drill)

    un = sub.add_parser("uncordon", help="operator: clear this node's cordon marker")
    un.add_argument("--state-dir", default="/var/lib/sentinel")
    un.set_defaults(func=cmd_uncordon)

    la = sub.add_parser("launch", help="run the torchrun agent under a pidfile the daemon drains (refuses on a cordoned node)")
    la.add_argument("--pidfile", default=os.path.join(os.environ.get("SENTINEL_RUNTIME_DIR", "/run/sentinel"), "agent.pid"))
    la.add_argument("--state-dir", default="/var/lib/sentinel")
    la.add_argument("command", nargs=argparse.REMAINDER)
    la.set_defaults(func=cmd_launch)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
