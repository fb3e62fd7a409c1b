"""The restore plan of the memory tier (trainer/memory/plan.py, with the slot format it reads) is
pure: it imports and runs without torch. (Module and function sizes and import cycles of trainer/
are checked with sentinel/'s in tests/test_structure.py.)"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


PURE = r"""
import sys
sys.modules["torch"] = None  # any import of torch now fails
from trainer.memory.plan import DISK, plan_restore, ring_partners
from trainer.memory.slot import COMPLETE, OWN, REPLICA, SlotInfo, slot_name
from trainer.memory import plan_restore as again

def info(role, shard, step, slot=0):
    return SlotInfo(slot_name(role, shard, slot), role, shard, slot, COMPLETE, step, 100, None,
                    {"run": "r", "world": 4, "shard": shard})

# node B (ranks 2, 3) is gone and a new node C took its place: its shards come from A's replicas,
# except shard 3, whose replica is lost too: it is read from the disk snapshot of step 7
found = {"A": [info(OWN, 0, 7), info(OWN, 1, 7), info(REPLICA, 2, 7)]}
plan, why = plan_restore(4, ["A", "A", "C", "C"], found, disk_step=7)
assert again is plan_restore and why == "", why
print(plan.step, plan.local, plan.peer, plan.disk, plan.senders[2], plan.senders[3] == DISK, ring_partners(0, 4, 2))
"""


def test_the_restore_plan_imports_and_runs_without_torch():
    r = subprocess.run([sys.executable, "-c", PURE], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["7", "[0,", "1]", "[2]", "[3]", "0", "True", "(2,", "2)"]
