"""The installed runtime (`sgl_vtoken/`, `kernels/`, `patches/`) never imports the tooling
(`sgl_vtoken_tools`, in tools/): not at module level, not inside a function, not through
importlib. The runtime's wheel (what `pip install .` installs next to SGLang) holds the runtime's
packages only, the tooling's wheel (`pip install ./tools`) the tooling only. And no module outside
the tests grows past 500 lines: modules are split by concept, and one heading past ~400 lines is a
candidate for splitting in review (docs/design.md, "Layout and checks")."""

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("sgl_vtoken", "kernels", "patches")
TOOLS = "sgl_vtoken_tools"  # the import name
TOOLS_DIR = "tools/sgl_vtoken_tools"  # where it lives (its distribution: tools/pyproject.toml)


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
    assert not any(TOOLS in n for n in names)


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
        return importlib.import_module("sgl_vtoken_tools.models"), __import__("sgl_vtoken_tools")
'''
    assert sorted(tools_imports(planted)) == [
        (3, "sgl_vtoken_tools.bench"),
        (9, "sgl_vtoken_tools.launcher"),
        (14, "sgl_vtoken_tools"),
        (14, "sgl_vtoken_tools.models"),
    ]
    assert tools_imports("import sgl_vtoken\nfrom sgl_vtoken.patches import register\n") == []


def test_no_module_outside_the_tests_is_over_500_lines():
    files = {
        p.resolve() for d in (*RUNTIME, TOOLS_DIR, "scripts") for p in (REPO / d).rglob("*.py")
    }
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in files}
    assert len(sizes) > 100 and {name: n for name, n in sizes.items() if n > 500} == {}


# What a build reads: the checkout less what is generated (a stale build/lib would go into the
# wheel as it is) or heavy and read by no build (docs/ holds the figures).
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".cache",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "docs",
)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, list[str]]:
    """{"runtime": names, "tools": names}: the files of the wheels `pip wheel . --no-deps` and
    `pip wheel ./tools --no-deps` build from a clean copy of the checkout (offline, with this
    environment's setuptools; a few seconds)."""
    src = tmp_path_factory.mktemp("checkout") / "repo"
    shutil.copytree(REPO, src, ignore=NOT_COPIED, symlinks=True)
    out = {}
    for kind, project in (("runtime", src), ("tools", src / "tools")):
        dest = tmp_path_factory.mktemp(f"wheel-{kind}")
        cmd = [sys.executable, "-m", "pip", "wheel", str(project), "--no-deps"]
        cmd += ["--no-build-isolation", "--no-index", "-q", "-w", str(dest)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (wheel,) = dest.glob("*.whl")
        out[kind] = zipfile.ZipFile(wheel).namelist()
    return out


def _packages(names: list[str]) -> set[str]:
    """The dotted packages of a wheel's modules."""
    return {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith(".py")}


def test_the_runtime_wheel_holds_the_runtime_only(wheels):
    names = wheels["runtime"]
    assert not [n for n in names if TOOLS in n], "the runtime's wheel ships the tooling"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert _packages(names) == set(config["tool"]["setuptools"]["packages"])
    assert {
        "sgl_vtoken/step.py",
        "sgl_vtoken/policies/base.py",
        "sgl_vtoken/kernels/repack_api.py",
        "sgl_vtoken/patches/plugin.py",
    } <= set(names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points.startswith("sgl_vtoken-")


def test_the_tools_wheel_holds_the_tooling_only(wheels):
    packages = _packages(wheels["tools"])
    assert {TOOLS, f"{TOOLS}.bench", f"{TOOLS}.quality", f"{TOOLS}.cli"} <= packages
    assert all(p == TOOLS or p.startswith(TOOLS + ".") for p in packages), packages


def test_the_tooling_requires_the_runtime_of_its_version():
    runtime = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    tools = tomllib.loads((REPO / "tools" / "pyproject.toml").read_text())["project"]
    assert f"{runtime['name']}=={runtime['version']}" in tools["dependencies"]
    assert tools["version"] == runtime["version"]
