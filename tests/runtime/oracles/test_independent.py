"""The oracles share no code with what they check: no module of `tests/runtime/oracles` (its tests
aside, which compare with the runtime) imports `sgl_vtoken`, `sgl_vtoken_tools` or `patches`,
and `hf_reference`'s victim choice reaches the runtime only through `runtime_choice` (the
adapter, its default) and reads `sgl_vtoken.config` only for settings (and `hf_rules`, the
interfaces it asks through). Imports are found anywhere
in a module: at module level, inside functions, through `importlib.import_module` / `__import__`.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ORACLES = Path(__file__).resolve().parent
HF_REFERENCE = REPO / "tools" / "sgl_vtoken_tools" / "hf_reference.py"
RUNTIME = ("sgl_vtoken", "sgl_vtoken_tools", "patches", "kernels")
HF_ALLOWED = {"sgl_vtoken.config", "sgl_vtoken_tools.hf_rules", "sgl_vtoken_tools.runtime_choice"}


def imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `source`, including ``from X import y`` as
    ``X.y`` (a submodule may be imported that way) and literal dynamic imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def of_runtime(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in RUNTIME)


def test_the_finder_sees_imports_anywhere():
    src = (
        "import torch\nfrom sgl_vtoken import policies\n"
        "def f():\n    import sgl_vtoken.patches.plugin\n"
        "    return importlib.import_module('sgl_vtoken.recall')\n"
        "class C:\n    def g(self):\n        from sgl_vtoken_tools.runtime_choice import X\n"
    )
    assert [n for _, n in imports(src) if of_runtime(n)] == [
        "sgl_vtoken",
        "sgl_vtoken.policies",
        "sgl_vtoken.patches.plugin",
        "sgl_vtoken.recall",
        "sgl_vtoken_tools.runtime_choice",
        "sgl_vtoken_tools.runtime_choice.X",
    ]


def test_no_oracle_module_imports_the_runtime():
    modules = [p for p in sorted(ORACLES.glob("*.py")) if not p.name.startswith("test_")]
    assert {p.name for p in modules} >= {"__init__.py", "request.py", "recall.py", "scores.py"}
    bad = [
        f"{p.relative_to(REPO)}:{line}: {name}"
        for p in modules
        for line, name in imports(p.read_text())
        if of_runtime(name) or not (name.split(".")[0] in ("torch", "__future__") or _stdlib(name))
    ]
    assert not bad, "an oracle imports outside torch and the standard library:\n" + "\n".join(bad)


def _stdlib(name: str) -> bool:
    import sys

    return name.split(".")[0] in sys.stdlib_module_names


def test_hf_reference_reaches_the_runtime_only_through_the_adapter():
    found = [(line, n) for line, n in imports(HF_REFERENCE.read_text()) if of_runtime(n)]
    bad = [
        f"hf_reference.py:{line}: {n}"
        for line, n in found
        if not any(n == a or n.startswith(a + ".") for a in HF_ALLOWED)
    ]
    assert not bad, "hf_reference imports the runtime's choice directly:\n" + "\n".join(bad)
    assert {n for _, n in found} >= {"sgl_vtoken_tools.runtime_choice"}, found
