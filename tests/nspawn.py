"""A real systemd, booted with ``systemd-nspawn`` over the host's own ``/usr``, for unit tests.

The container stands in for a GPU node's host: it keeps what a host's PID 1 has and nspawn takes
away by default (CAP_BPF, CAP_PERFMON, CAP_SYSLOG, the ``bpf``/``perf_event_open`` syscalls,
``/dev/kmsg``, tracefs), so that what limits the daemon is the unit's own hardening and nothing
else. ``--volatile=yes`` gives it an empty ``/etc`` (tmpfs): the unit, its config directory, a
"disable everything" preset (a first boot would otherwise enable and start every unit it sees)
and masks for the first-boot wizard and the network-online wait are bind-mounted in.

Files under ``<host>/`` (the venv with the installed wheel, the simulated GPU state, the config)
are bound at the same path inside, so the venv's absolute paths work there. That directory is
not under ``/tmp`` or ``/var/tmp``: the unit's ``PrivateTmp=yes`` hides both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

NSPAWN = "/usr/bin/systemd-nspawn"


class Container:
    def __init__(self, host_dir: Path, name: str, binds: list[tuple[str, str]] = (), ro_binds: list[tuple[str, str]] = ()):
        self.host_dir = host_dir
        self.name = name
        self.binds = list(binds)
        self.ro_binds = list(ro_binds)
        self.proc: subprocess.Popen | None = None
        self.leader = 0
        self.console = host_dir / "console.log"

    def boot(self, timeout: float = 240) -> None:
        preset = self.host_dir / "disable-all.preset"
        preset.write_text("disable *\n")
        argv = [NSPAWN, "-D", "/", "--volatile=yes", "-b", "--private-network", "--register=no", "--keep-unit",
                "-M", self.name, "--console=pipe",
                "--capability=CAP_BPF,CAP_PERFMON,CAP_SYSLOG", "--system-call-filter=bpf perf_event_open",
                "--bind=/dev/kmsg", f"--bind={self.host_dir}",
                f"--bind-ro={preset}:/etc/systemd/system-preset/00-disable-all.preset",
                "--bind-ro=/dev/null:/etc/systemd/system/systemd-firstboot.service",
                "--bind-ro=/dev/null:/etc/systemd/system/systemd-networkd-wait-online.service"]
        argv += [f"--bind={src}:{dst}" for src, dst in self.binds]
        argv += [f"--bind-ro={src}:{dst}" for src, dst in self.ro_binds]
        argv += ["--", "systemd.firstboot=off", "systemd.unit=multi-user.target"]
        with open(self.console, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited {self.proc.returncode}: {self.console.read_text()[-3000:]}")
            if not self.leader:
                self.leader = self._child_of(self.proc.pid)
            if self.leader:
                try:
                    r = self.run(["systemctl", "is-system-running"], check=False, timeout=10)
                except subprocess.TimeoutExpired:
                    state = "systemctl is-system-running timed out"
                    continue
                state = (r.stdout + r.stderr).strip()
                if r.stdout.strip() in ("running", "degraded"):
                    break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the container did not finish booting in {timeout}s ({self._stuck(state)}); "
                                 f"console: {self.console.read_text()[-3000:]!r}")
        # a host mounts tracefs at boot (sys-kernel-tracing.mount); a container skips it
        self.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"])
        # nspawn overmounts boot_id with a random one, which a sandboxed service (its own /proc)
        # does not see: the agent's launcher and the daemon would disagree about the boot, as
        # they never do on a host
        self.run(["umount", "/proc/sys/kernel/random/boot_id"])

    def _stuck(self, state: str) -> str:
        """Where a boot that did not finish stands: nspawn's and the container init's kernel wait
        channels, the last systemctl answer, and the jobs still queued (an empty console once)."""
        def wchan(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/wchan").read_text() or "running"
            except OSError:
                return "gone"
        told = [f"nspawn pid {self.proc.pid} in {wchan(self.proc.pid)}", f"init pid {self.leader or 'not found'}"]
        if self.leader:
            told.append(f"in {wchan(self.leader)}; last is-system-running: {state!r}")
            try:
                jobs = self.run(["systemctl", "list-jobs", "--no-pager"], check=False, timeout=10)
                told.append(f"jobs: {(jobs.stdout + jobs.stderr)[-1500:]!r}")
            except subprocess.TimeoutExpired:
                told.append("systemctl list-jobs timed out")
        return "; ".join(told)

    @staticmethod
    def _child_of(pid: int) -> int:
        """The container's init: nspawn's child running systemd. nspawn first forks an
        intermediate child that sets up the namespaces and exits; taken for the init on a loaded
        host, it left a boot waiting on a dead pid until its timeout (twice in side-by-side runs)."""
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_bytes()
            except OSError:
                continue
            comm = stat[stat.index(b"(") + 1:stat.rindex(b")")]
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid and comm == b"systemd":
                return int(entry.name)
        return 0

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60, namespaces: str = "-a",
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the container (all namespaces; ``namespaces="-n"``: its network only)."""
        r = subprocess.run(["nsenter", "-t", str(self.leader), namespaces, "--", *argv], capture_output=True,
                           text=True, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run(["systemctl", "show", unit, "--timestamp=us+utc", "-p", ",".join(props)]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run(["journalctl", "-u", unit, "--no-pager", "-o", "cat"]).stdout

    def path(self, inside: str) -> Path:
        """A path inside the container, seen from the host."""
        return Path(f"/proc/{self.leader}/root") / inside.lstrip("/")

    def wait_for(self, predicate, timeout: float, what: str):
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            last = predicate()
            if last:
                return last
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")

    def halt(self) -> None:
        """SIGTERM to nspawn halts the container cleanly (SIGKILL would leave its mounts behind)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
