"""patches/ has no import cycle: modules import each other at module level, in one direction
(shared settings live in `server_args.py`, hooked targets in `contract.py`); and no module of it
grows past 300 lines."""

import ast
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[2] / "patches"
PACKAGE = "sgl_vtoken.patches"


def import_graph() -> dict[str, set[str]]:
    """Module -> the `patches/` modules it imports at module level (`from .x import`,
    `from . import x`, `from sgl_vtoken.patches.x import`)."""
    modules = {p.stem for p in PATCHES.glob("*.py")}
    graph = {}
    for path in PATCHES.glob("*.py"):
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1:
                module = node.module
            elif node.level == 0 and (node.module or "").startswith(PACKAGE):
                module = node.module[len(PACKAGE):].lstrip(".") or None
            else:
                continue
            deps |= {module.split(".")[0]} if module else {a.name for a in node.names}
        graph[path.stem] = deps & modules
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_patches_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in patches/: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PATCHES.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 300} == {}


def test_the_graph_sees_the_plugin_importing_its_hook_modules():
    graph = import_graph()
    assert {"runtime", "server_args", "attention", "radix"} <= graph["plugin"]
