"""A standalone c10d TCPStore host for the rendezvous (`--rdzv-conf is_host=false` on every agent).

The c10d rendezvous keeps its store in the first agent whose host matches the endpoint, and
killing that agent killed the job in our measurements. A store process of its own survives any
node's failure. In production use a stable store host (or the etcd-v2 rendezvous backend).

    python -m trainer.store --port 29400
"""

from __future__ import annotations

import argparse
import signal
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=24))
    print(f"store listening on {args.host}:{args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.pause()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
