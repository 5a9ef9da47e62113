"""The benchmark and quality scripts run as `python scripts/X.py` over the installed package: `--help`
answers with status 0 from any working directory, with no sys.path edit to lean on."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


@pytest.mark.parametrize(
    "script,flag",
    [
        ("bench_chat.py", "--one-at-a-time"),
        ("bench_joint.py", "--cells"),
        ("bench_ladder.py", "--loads"),
        ("chat_clients.py", "--stuck-after"),
        ("eval_quality.py", "--settings"),
        ("kvpress_eval.py", "--modes"),  # without kvpress installed: it is imported only to run
        ("mutation_check.py", "--only"),
    ],
)
def test_help_exits_0(script, flag, tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert flag in out.stdout
