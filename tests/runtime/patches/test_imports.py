"""The runtime (`sgl_vtoken/`, `kernels/`, `patches/`) has no import cycle: counting every import,
inside functions and under `if TYPE_CHECKING:` too, modules import each other in one direction.
And `patches/` is layered: a module imports only its own layer and the layers below it (LAYERS)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Installed module prefix of each runtime folder (pyproject.toml's package-dir).
FOLDERS = {
    "sgl_vtoken": "sgl_vtoken",
    "kernels": "sgl_vtoken.kernels",
    "patches": "sgl_vtoken.patches",
}


def module_names() -> dict[str, Path]:
    """Installed module name -> file, for every runtime module (a package by its `__init__`)."""
    out = {}
    for folder, prefix in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("").parts
            if rel[0] in ("kernels", "patches"):  # links some checkouts keep inside sgl_vtoken/
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((prefix, *parts))] = path
    return out


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The runtime modules `source` (module `name`) imports anywhere, resolved to names in `known`:
    `import a.b`, `from a import b` (module b, else package a), relative imports."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a package: its deepest module
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
    return deps


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {
        name: imports_of(name, path.read_text(), path.name == "__init__.py", set(names))
        for name, path in names.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_runtime_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in the runtime: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_imports_inside_functions_and_for_type_checking():
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    source = """
from typing import TYPE_CHECKING
from . import a
if TYPE_CHECKING:
    from .d import D

def f():
    from .b import thing
    import p.c
"""
    assert imports_of("p.x", source, False, known) == {"p.a", "p.b", "p.c", "p.d"}


def test_the_graph_sees_the_plugin_importing_its_hook_modules():
    graph = import_graph()
    assert {
        "sgl_vtoken.patches.runtime",
        "sgl_vtoken.patches.surface.server_args",
        "sgl_vtoken.patches.attention",
        "sgl_vtoken.patches.cache.radix",
    } <= graph["sgl_vtoken.patches.plugin"]
    assert "sgl_vtoken.policies" in graph["sgl_vtoken.config"]


# `patches/`, top layer first: a module may import its own layer and those after it. The top holds
# the hook entry points and the attention backend; `core` the leaf services.
LAYERS = ("", "surface", "step", "cache", "core")
PATCHES = "sgl_vtoken.patches"


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a `patches` module (None: not in `patches`)."""
    if module != PATCHES and not module.startswith(PATCHES + "."):
        return None
    parts = module[len(PATCHES) + 1 :].split(".") if module != PATCHES else []
    return LAYERS.index(parts[0]) if len(parts) > 1 and parts[0] in LAYERS else 0


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a `patches` module `b` from a lower layer's module `a`."""
    return [
        f"{a} -> {b}"
        for a, deps in sorted(graph.items())
        for b in sorted(deps)
        if (la := layer_of(a)) is not None and (lb := layer_of(b)) is not None and lb < la
    ]


def test_patches_layers_import_only_downward():
    bad = upward_imports(import_graph())
    assert not bad, "a patches/ layer imports a layer above it:\n" + "\n".join(bad)


def test_every_patches_folder_is_a_layer():
    folders = {p.name for p in (REPO / "patches").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {""}


def test_the_layer_check_finds_an_upward_import():
    graph = {
        f"{PATCHES}.cache.pool": {f"{PATCHES}.core.shortage"},
        f"{PATCHES}.cache.radix": {f"{PATCHES}.step.retraction"},
        f"{PATCHES}.runtime": {f"{PATCHES}.surface.observe", "sgl_vtoken.config"},
    }
    assert upward_imports(graph) == [f"{PATCHES}.cache.radix -> {PATCHES}.step.retraction"]
