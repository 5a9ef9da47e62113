"""The benchmark scripts are thin command lines over sgl_vtoken_tools.bench: they start without
sglang (no server, no model), and bad flags stop them with status 2 naming the flag."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def run(script: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "script,flags",
    [
        ("bench_eviction.py", ("--part", "--quick")),
        ("bench_agent.py", ("--base-url", "--cells", "--split", "--tool-tokens", "--report")),
        ("bench_matrix.py", ("--repeats", "--render-only", "--jsonl")),
        ("stress.py", ("--duration", "--workers", "--page-size")),
    ],
)
def test_help_lists_the_flags(script, flags):
    out = run(script, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f in out.stdout for f in flags)


@pytest.mark.parametrize(
    "script,argv,flag",
    [
        ("bench_agent.py", ("--tool-tokens", "500", "200"), "--tool-tokens"),
        ("bench_agent.py", ("--sessions", "0"), "--sessions"),
        ("bench_agent.py", ("--turns", "10", "8"), "--turns"),
        ("bench_agent.py", ("--split", "test"), "--split"),
        ("bench_agent.py", ("--cells", "nonesuch"), "--cells"),
        ("bench_agent.py", ("--base-url", "http://127.0.0.1:9", "--cells", "a={"), "--cells"),
        ("bench_matrix.py", ("--repeats", "0", "--model-path", "/nonexistent"), "repeats"),
        ("stress.py", ("--server-log", "x.log"), "--server-log"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(script, argv, flag):
    out = run(script, *argv)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert flag in out.stderr.splitlines()[-1]


def test_no_script_edits_sys_path():
    """Scripts import the installed package, never each other through sys.path."""
    scripts = sorted(SCRIPTS.glob("*.py"))
    assert len(scripts) > 10
    for path in scripts:
        assert "sys.path" not in path.read_text(), path.name
