"""scripts/gpu_check.sh's CPU dry run (`GPU_CHECK_DRY=1`): the prepared GPU run's every step
runs on tiny shapes under the interpreter and passes, the graph step's replays equal eager."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_dry_run_of_every_step_passes(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    steps = [line for line in summary.splitlines() if line[:2] in {f"{i} " for i in range(1, 6)}]
    assert [s.split()[0] for s in steps] == ["1", "2", "3", "4", "5"], summary
    assert all("rc=0" in s for s in steps), summary
    graph = [
        json.loads(x) for x in (tmp_path / "bench_graph_scores.jsonl").read_text().split("\n") if x
    ]
    assert [g["batch"] for g in graph] == [1, 4] and all(g["equal"] for g in graph), graph
