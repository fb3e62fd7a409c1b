"""A fake Slurm for attacks by a misbehaving scheduler: ``scontrol``, ``sinfo``, ``squeue`` and
``scancel`` are one script on PATH (:meth:`SlurmStub.env`) that keeps the nodes in a JSON file and
logs every call. What each answers can be made bad: raw bytes appended to a node's line (not
UTF-8), raw ``squeue`` output, a controller that hangs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SCRIPT = r'''#!{python}
import fcntl, json, os, sys, time
d = os.environ["SLURM_STUB_DIR"]
prog, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.path.join(d, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"prog": prog, "argv": argv, "start": time.time()}}) + "\n")
with open(os.path.join(d, "lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    state = json.load(open(os.path.join(d, "state.json")))
    if state.get("hang"):
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.execvp("sleep", ["sleep", "600"])
    out = sys.stdout.buffer
    nodes = state["nodes"]
    def stamp(t):
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))
    if prog == "scontrol" and argv[:2] == ["show", "node"]:
        name = argv[2]
        if name not in nodes:
            sys.stderr.write("Node %s not found\n" % name); sys.exit(1)
        n = nodes[name]
        line = "NodeName=%s Arch=x86_64 State=%s Partitions=gpu" % (name, n["state"])
        if n.get("reason"):
            line += " Reason=%s [root@%s]" % (n["reason"], stamp(n["time"]))
        out.write(line.encode() + bytes.fromhex(n.get("raw", "")) + b"\n")
    elif prog == "scontrol" and argv[0] == "update":
        kv = dict(a.split("=", 1) for a in argv[1:])
        if "jobid" in kv:  # the spare choice written into the job's Comment (sentinel.topology)
            state.setdefault("comments", dict())[kv["jobid"]] = kv.get("comment", "")
            json.dump(state, open(os.path.join(d, "state.json"), "w"))
            sys.exit(0)
        n = nodes[kv["nodename"]]
        if "comment" in kv:  # a failing node's spare record (sentinel.backends.slurm)
            n["comment"] = kv["comment"]
        elif kv["state"] == "drain":
            n.update(state="IDLE+DRAIN", reason=kv.get("reason", ""), time=time.time())
        elif kv["state"] == "resume":
            n.update(state="IDLE", reason="", time=0)
        json.dump(state, open(os.path.join(d, "state.json"), "w"))
    elif prog == "sinfo":
        for name, n in sorted(nodes.items()):
            t = stamp(n["time"]) if n.get("reason") else "Unknown"
            out.write(("%s|%s|%s|" % (name, n["state"].lower(), t)).encode() + n.get("reason", "").encode()
                      + bytes.fromhex(n.get("raw", "")) + b"\n")
    elif prog == "squeue":
        out.write(bytes.fromhex(state.get("squeue", "")))
    elif prog == "scancel":
        pass
'''


class SlurmStub:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2", "n3", "n4")) -> None:
        self.dir = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        script = self.bin / "slurm-stub"
        script.write_text(SCRIPT.format(python=sys.executable))
        script.chmod(0o755)
        for prog in ("scontrol", "sinfo", "squeue", "scancel"):
            (self.bin / prog).symlink_to(script)
        self.write({"nodes": {n: {"state": "IDLE", "reason": "", "time": 0} for n in nodes}})
        (root / "calls.jsonl").touch()

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "SLURM_STUB_DIR": str(self.dir)}

    def read(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def write(self, state: dict) -> None:
        (self.dir / "state.json").write_text(json.dumps(state))

    def update(self, **changes) -> None:
        state = self.read()
        state.update(changes)
        self.write(state)

    def node(self, name: str, **changes) -> None:
        state = self.read()
        state["nodes"][name].update(changes)
        self.write(state)

    def drain(self, name: str, reason: str, raw: bytes = b"", age: float = 0.0) -> None:
        self.node(name, state="IDLE+DRAIN", reason=reason, time=time.time() - age, raw=raw.hex())

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "calls.jsonl").read_text().splitlines() if line]
