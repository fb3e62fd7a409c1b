"""Debian's Prometheus for tests: scrapes given targets every second, evaluates the shipped rule
files, answers the HTTP API on a free loopback port; stopped by pid, also on failure."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from sentinel_tools.ports import free_port


class Prometheus:
    """``targets``: host:port of each daemon, or a file_sd JSON file that the test rewrites as
    daemons come and go (Prometheus rereads it on change)."""

    def __init__(self, root: Path, targets: list[str] | Path, rule_files: list[Path] = (), job: str = "sentinel") -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()  # below the ephemeral range: no other suite's connection takes it first
        cfg = root / "prometheus.yml"
        rules = "".join(f"  - {p}\n" for p in rule_files)
        sd = (f"    file_sd_configs:\n      - files: [{json.dumps(str(targets))}]\n        refresh_interval: 1s\n"
              if isinstance(targets, Path) else f"    static_configs:\n      - targets: {json.dumps(targets)}\n")
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                       + (f"rule_files:\n{rules}" if rules else "")
                       + f"scrape_configs:\n  - job_name: {job}\n" + sd)
        self.log = root / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [shutil.which("prometheus") or "prometheus", f"--config.file={cfg}",
                 f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, path: str, **params: str):
        """``data`` of /api/v1/<path>, or None while Prometheus does not answer."""
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return json.load(resp)["data"]
        except OSError:
            return None

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        return data["result"] if data else []

    def firing(self, alertname: str) -> list[dict]:
        data = self.api("alerts") or {"alerts": []}
        return [a for a in data["alerts"] if a["labels"]["alertname"] == alertname and a["state"] == "firing"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
