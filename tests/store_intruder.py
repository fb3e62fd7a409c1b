"""Another local user writing into a job's c10d ``TCPStore`` (it has no authentication): a
stand-alone client of the store's wire protocol run as ``nobody`` with the system interpreter
(which has no torch), so a test shows what any local user can do, not what the job itself can."""

from __future__ import annotations

import subprocess

from conftest import SYSTEM_PYTHON

NOBODY = 65534

# torch's TCPStore protocol (torch/csrc/distributed/c10d/TCPStore.cpp): a one-byte query type,
# strings and values as a little-endian size_t length and the bytes; the python client's keys
# carry a leading "/". VALIDATE opens a connection; the GET at the end waits for the SETs.
CLIENT = r"""
import json, socket, struct, sys
VALIDATE, SET, GET = 0, 1, 3
port, items = int(sys.argv[1]), json.loads(sys.argv[2])
def s(b): return struct.pack("<Q", len(b)) + b
c = socket.create_connection(("127.0.0.1", port), timeout=20)
c.sendall(bytes([VALIDATE]) + struct.pack("<I", 0x3C85F7CE))
for key, value in items:
    c.sendall(bytes([SET]) + s(b"/" + key.encode()) + s(value.encode("latin-1")))
c.sendall(bytes([GET]) + s(b"/" + items[-1][0].encode()))
got = b""
while len(got) < 8:
    got += c.recv(8 - len(got))
print("planted", len(items))
"""


def plant(port: int, items: dict[str, bytes]) -> None:
    """Set ``items`` (key -> value) in the TCPStore on 127.0.0.1:``port`` as ``nobody``."""
    import json

    pairs = json.dumps([[k, v.decode("latin-1")] for k, v in items.items()])
    r = subprocess.run([SYSTEM_PYTHON, "-c", CLIENT, str(port), pairs], user=NOBODY, group=NOBODY, extra_groups=[],
                       env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "planted" in r.stdout, r.stderr
