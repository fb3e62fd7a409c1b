"""Size and shape limits for the daemon (``sentinel/``) and the trainer (``trainer/``), checked on
the source, so that the next engineer finds modules that fit on a screen:

* no module over :data:`MAX_MODULE_LINES` lines;
* no function (method, nested function) over :data:`MAX_FUNCTION_LINES` lines;
* no import cycle between their modules, counting imports made inside functions too (only
  ``if TYPE_CHECKING:`` blocks, which never run, are left out).

The checks are generic: they walk whatever ``.py`` files the packages hold, so a split or a new
module is checked with no edit here. A failure lists every offender and what to do about it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sentinel", "trainer")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages``."""
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement anywhere in ``tree`` may load (relative imports resolved)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = _imports(tree, name, path.name == "__init__.py")
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def _edge_chain(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One cycle through the component, spelled a -> b -> a, to say where to cut."""
    members = set(comp)
    start = comp[0]
    path, seen, node = [start], {start}, start
    while True:
        nxt = sorted(w for w in graph[node] if w in members)
        back = [w for w in nxt if w == start]
        if back and len(path) > 1:
            return " -> ".join(path + [start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return " <-> ".join(comp)
        node = fresh[0]
        path.append(node)
        seen.add(node)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_the_line_limit(package):
    long = []
    for name, path in modules((package,)).items():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"  {path.relative_to(ROOT)}: {n} lines")
    assert not long, (f"modules over {MAX_MODULE_LINES} lines; split each by concern (one file per part, "
                      f"behind the interface it already has):\n" + "\n".join(long))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_the_line_limit(package):
    long = []
    for name, path in modules((package,)).items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"  {path.relative_to(ROOT)}:{node.lineno} {node.name}(): {n} lines")
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines; move each step into a named helper:\n"
                      + "\n".join(long))


def test_no_import_cycle_even_inside_functions():
    graph = import_graph()
    found = cycles(graph)
    assert not found, ("import cycles (imports inside functions count; only `if TYPE_CHECKING:` blocks do not). "
                       "Cut each by moving what both sides need into a module that imports neither:\n"
                       + "\n".join("  " + _edge_chain(graph, comp) for comp in found))


def test_the_cycle_finder_finds_a_function_level_cycle(tmp_path):
    """The checker itself: an import inside a function is an edge, a TYPE_CHECKING import is not."""
    a = ast.parse("def f():\n    from pkg import b\n")
    b = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\nimport pkg.a\n")
    c = ast.parse("from . import a\n")
    graph = {
        "pkg.a": {m for m in _imports(a, "pkg.a", False) if m.startswith("pkg.")},
        "pkg.b": {m for m in _imports(b, "pkg.b", False) if m.startswith("pkg.")},
        "pkg.c": {m for m in _imports(c, "pkg.c", False) if m.startswith("pkg.")},
    }
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert _edge_chain(graph, ["pkg.a", "pkg.b"]) == "pkg.a -> pkg.b -> pkg.a"


def test_validating_a_config_loads_neither_the_http_server_nor_prometheus(tmp_path):
    """``sentinel.config`` checks the TLS and users files through :mod:`sentinel.httpauth` only:
    the HTTP server, its development ``serve`` command and prometheus_client stay off its path; the
    backends' settings come from their modules, never from their scheduler's client library."""
    import subprocess
    import sys

    from sentinel.httpauth import hash_password

    users = tmp_path / "users"
    users.write_text(f"prom:{hash_password('pw', iterations=1000)}\n")
    users.chmod(0o600)
    toml = f'[metrics]\nbasic_auth_users_file = "{users}"\n'
    code = ("import sys; from sentinel import config; config.parse(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m in ('sentinel.exporter', 'sentinel.metrics', "
            "'sentinel.sources.simulated', 'http.server', 'kubernetes') or m.startswith(('prometheus_client', 'kubernetes.'))))")
    r = subprocess.run([sys.executable, "-c", code, toml], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_drill_harness_fits_the_same_limits_and_has_no_import_cycle():
    """``sentinel_tools``' drill modules (the cluster runners, the faults, the report; not the
    goodput simulator under ``sentinel_tools/sim``) keep the daemon's limits too (#41's split)."""
    mods = {k: p for k, p in modules(("sentinel_tools",)).items() if not k.startswith("sentinel_tools.sim")}
    too_long = [f"{p.relative_to(ROOT)}: {n} lines" for p in mods.values()
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    long_functions = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}()" for p in mods.values()
                      for node in ast.walk(ast.parse(p.read_text(), str(p)))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    graph = {name: {t for t in _imports(ast.parse(p.read_text(), str(p)), name, p.name == "__init__.py")
                    if t in mods and t != name} for name, p in mods.items()}
    assert "sentinel_tools.drill_cluster" in mods and "sentinel_tools.faults.power_off" in mods
    assert not too_long and not long_functions and not cycles(graph), (too_long, long_functions, cycles(graph))
