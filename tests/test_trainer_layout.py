"""The trainer package stays navigable: one module per storage tier, none over 600 lines, no
function over 80 lines, no import cycle (function-level imports included), and the
restore plan importable and usable without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

TRAINER = Path(REPO) / "trainer"


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(TRAINER.rglob("*.py")):
        parts = path.relative_to(TRAINER.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every trainer module ``name`` imports, at module level or inside a function."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]  # a lazy export: a named module, or (a formatted name) any submodule
            targets = [arg.value] if isinstance(arg, ast.Constant) else [m for m in known if m.startswith(name + ".")]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def test_no_trainer_module_over_600_lines_and_no_function_over_80():
    too_long = {str(p.relative_to(TRAINER.parent)): n for p in TRAINER.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > 600}
    assert too_long == {}
    long_functions = []
    for p in TRAINER.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{p.relative_to(TRAINER.parent)}:{node.lineno} {node.name}")
    assert long_functions == []


def test_no_import_cycle_in_trainer():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    # a package's __init__ runs before any of its submodules: a submodule importing its own package
    # is not an edge (it is already importing); only real module -> module imports count
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
    assert "trainer.memory.tier" in graph["trainer.memory"] and "trainer.guard" in graph["trainer"]  # lazy exports seen


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
