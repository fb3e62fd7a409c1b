"""`sentinel run` imports the daemon only: never the drill harness (which mounts tmpfs and kills
process trees), the goodput Monte Carlo, or the simulator unless --simulate asks for it."""

from __future__ import annotations

import subprocess
import sys

TOOLS = ("sentinel_tools.drill", "sentinel_tools.sim.goodput", "sentinel.sources.simulated")


def test_parsing_a_daemon_command_loads_no_tool():
    code = ("import sys; from sentinel import cli; "
            "[cli.build_parser(c).parse_args(a) for c, a in (('run', ['run', '--no-ebpf']), ('status', ['status']), "
            "('launch', ['launch', '--', 'true']), ('uncordon', ['uncordon']))]; "
            f"print(sorted(m for m in {TOOLS!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_running_daemon_never_imported_the_drill_or_goodput(sim_state, start_daemon):
    d = start_daemon("--simulate", str(sim_state), env={"PYTHONPROFILEIMPORTTIME": "1"})
    d.scrape()
    assert d.stop() == 0
    log = d.log()
    assert "sentinel.daemon" in log  # the import-time profile is there
    for module in ("sentinel_tools.drill", "sentinel_tools.sim.goodput"):
        assert f"| {module}\n" not in log and f"|   {module}\n" not in log and f" {module}\n" not in log, module


def test_tool_commands_still_have_their_arguments():
    for argv in (["drill", "--help"], ["simulate", "goodput", "--help"], ["inject", "--help"]):
        r = subprocess.run([sys.executable, "-m", "sentinel", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage:" in r.stdout and len(r.stdout.splitlines()) > 4, (argv, r.stderr)
