"""The installed runtime (`sgl_vtoken/`, `kernels/`, `patches/`) never imports the tooling
(`sgl_vtoken_tools`): not at module level, not inside a function, not through importlib. And no
module outside the tests grows past 500 lines: modules are split by concept, and one heading past
~400 lines is a candidate for splitting in review (docs/design.md, "Layout and checks")."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("sgl_vtoken", "kernels", "patches")
TOOLS = "sgl_vtoken_tools"


def runtime_files() -> list[Path]:
    """Every module of the runtime, once (a checkout may link `sgl_vtoken/kernels` and
    `sgl_vtoken/patches` to the top-level folders)."""
    files = {p.resolve() for d in RUNTIME for p in (REPO / d).rglob("*.py")}
    return sorted(files)


def _is_tools(name: str | None) -> bool:
    return name is not None and (name == TOOLS or name.startswith(TOOLS + "."))


def tools_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of the tooling anywhere in `source`: `import`, `from ...
    import`, and `importlib.import_module` / `__import__` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_tools(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_tools(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", None)
            )
            if func in ("import_module", "__import__") and _is_tools(node.args[0].value):
                found.append((node.lineno, node.args[0].value))
    return found


def test_the_runtime_never_imports_the_tooling():
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in runtime_files()
        for line, name in tools_imports(path.read_text())
    ]
    assert not bad, "the runtime imports sgl_vtoken_tools:\n" + "\n".join(bad)


def test_the_runtime_files_are_the_runtime():
    names = {str(p.relative_to(REPO)) for p in runtime_files()}
    assert {
        "patches/plugin.py",
        "kernels/repack_api.py",
        "sgl_vtoken/step.py",
        "sgl_vtoken/policies/base.py",
    } <= names
    assert not any(n.startswith(TOOLS) for n in names)


def test_the_finder_sees_imports_anywhere():
    planted = '''
"""Docs may name sgl_vtoken_tools.launcher."""
import os, sgl_vtoken_tools.bench as b
from sgl_vtoken import step
from sgl_vtoken.kernels import repack_kv_
import sgl_vtoken_toolsx

def f():
    from sgl_vtoken_tools.launcher import ServerProcess

class C:
    def g(self):
        import importlib
        return importlib.import_module("sgl_vtoken_tools.sim"), __import__("sgl_vtoken_tools")
'''
    assert sorted(tools_imports(planted)) == [
        (3, "sgl_vtoken_tools.bench"),
        (9, "sgl_vtoken_tools.launcher"),
        (14, "sgl_vtoken_tools"),
        (14, "sgl_vtoken_tools.sim"),
    ]
    assert tools_imports("import sgl_vtoken\nfrom sgl_vtoken.patches import register\n") == []


def test_no_module_outside_the_tests_is_over_500_lines():
    files = {p.resolve() for d in (*RUNTIME, TOOLS, "scripts") for p in (REPO / d).rglob("*.py")}
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    assert len(sizes) > 100 and {name: n for name, n in sizes.items() if n > 500} == {}
