"""Stands in for torchrun in the agent unit under nspawn: the agent is also the job's one rank.

It registers with the daemon's control channel, records each request it receives in OUT_DIR
(``request-<id>``, with the uid it runs as), acknowledges a migrate request only once
``OUT_DIR/ack-now`` exists (so a test can restart the daemon while the migration waits), then
keeps running until the drain's SIGTERM, which it records as ``drained``. Bounded: it exits
after 300 s whatever happens.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from sentinel.channel import Ack, RankEndpoint

out = Path(os.environ["FAKE_RANK_OUT"])
done = False


def on_term(signum, frame):
    global done
    done = True


signal.signal(signal.SIGTERM, on_term)
rank = RankEndpoint.open(Path("/run/sentinel"))
(out / "registered").write_text(f"{os.getuid()} {type(rank).__name__}\n")
acked: set[str] = set()
pending: list = []
end = time.monotonic() + 300
while not done and time.monotonic() < end:
    for req in rank.poll():
        (out / f"request-{req.id}").write_text(f"{os.getuid()} {req.type}\n")
        if req.type == "migrate" and req.id not in acked:
            pending.append(req)
    if pending and (out / "ack-now").exists():
        for req in pending:
            rank.ack(Ack(id=req.id, rank=0, step=42, ok=True, path="/snapshots/step-42"))
            acked.add(req.id)
        pending.clear()
    time.sleep(0.1)
(out / "drained").write_text("SIGTERM\n" if done else "timeout\n")
rank.close()
sys.exit(0 if done else 1)
