"""Every command of `python -m sgl_vtoken_tools` answers `--help` with status 0 from any working
directory, over the installed package and without its heavy dependencies loaded for it; the list
of commands names every module of `sgl_vtoken_tools.cli` that has a `main`."""

import subprocess
import sys
from pathlib import Path

import pytest

from sgl_vtoken_tools.__main__ import usage
from sgl_vtoken_tools.cli import COMMANDS

FLAGS = {  # a flag each command's help must name
    "chat": "--one-at-a-time",
    "joint": "--cells",
    "ladder": "--loads",
    "quality": "--settings",
}


def run(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_vtoken_tools", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_exits_0(name, tmp_path):
    out = run(name, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"python -m sgl_vtoken_tools {name}" in out.stdout
    assert FLAGS.get(name, "--help") in out.stdout


def test_the_list_names_every_command_module():
    out = run()
    assert out.returncode == 0 and out.stdout.strip() == usage().strip()
    assert all(name in out.stdout for name in COMMANDS)
    cli = Path(__file__).resolve().parents[3] / "tools" / "sgl_vtoken_tools" / "cli"
    mains = {p.stem for p in cli.glob("*.py") if "\ndef main(" in p.read_text()}
    assert mains == {module for module, _ in COMMANDS.values()}
    bad = run("nonesuch")
    assert bad.returncode == 2 and "unknown command 'nonesuch'" in bad.stderr
