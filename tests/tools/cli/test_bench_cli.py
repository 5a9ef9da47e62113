"""The benchmark commands are thin command lines over sgl_vtoken_tools.bench: they start without
sglang (no server, no model), and bad flags stop them with status 2 naming the flag."""

import subprocess
import sys
from pathlib import Path

import pytest


def run(command: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_vtoken_tools", command, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "command,flags",
    [
        ("eviction", ("--part", "--quick")),
        ("agent", ("--base-url", "--cells", "--split", "--tool-tokens", "--report")),
        ("matrix", ("--repeats", "--render-only", "--jsonl")),
        ("stress", ("--duration", "--workers", "--page-size")),
    ],
)
def test_help_lists_the_flags(command, flags):
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f in out.stdout for f in flags)


@pytest.mark.parametrize(
    "command,argv,flag",
    [
        ("agent", ("--tool-tokens", "500", "200"), "--tool-tokens"),
        ("agent", ("--sessions", "0"), "--sessions"),
        ("agent", ("--turns", "10", "8"), "--turns"),
        ("agent", ("--split", "test"), "--split"),
        ("agent", ("--cells", "nonesuch"), "--cells"),
        ("agent", ("--base-url", "http://127.0.0.1:9", "--cells", "a={"), "--cells"),
        # the README's chat command chunks its prefill, which the overlap scheduler cannot run
        ("agent", ("--cells", "stock", "pressure"), "--disable-overlap-schedule"),
        ("matrix", ("--repeats", "0", "--model-path", "/nonexistent"), "repeats"),
        ("stress", ("--server-log", "x.log"), "--server-log"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(command, argv, flag):
    out = run(command, *argv)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert flag in out.stderr.splitlines()[-1]


def test_no_command_edits_sys_path():
    """Commands import the installed package, never each other through sys.path."""
    cli = Path(__file__).resolve().parents[3] / "tools" / "sgl_vtoken_tools" / "cli"
    modules = sorted(cli.glob("*.py"))
    assert len(modules) > 10
    for path in modules:
        assert "sys.path" not in path.read_text(), path.name
