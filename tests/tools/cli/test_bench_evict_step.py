"""`python -m sgl_vtoken_tools evict-step` drives the real step and its per-row oracle on a fake
pool: both paths move the same tokens, the batched one in one repack launch."""

import json
import subprocess
import sys

COMMAND = [sys.executable, "-m", "sgl_vtoken_tools", "evict-step"]


def evict_step(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=timeout)


def lines_of(proc: subprocess.CompletedProcess, out) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_both_paths_evict_the_same_tokens_and_the_batched_one_launches_once(tmp_path):
    out = tmp_path / "step.jsonl"
    proc = evict_step(
        *("--device", "cpu", "--batches", "3", "--budget", "40", "--intervals", "16"),
        *("--repeats", "1", "--policies", "random,knorm,h2o", "--out", str(out)),
        timeout=300,
    )
    lines = lines_of(proc, out)
    assert not [x for x in lines if "error" in x]
    assert len(lines) == 6
    for batched, per_row in zip(lines[0::2], lines[1::2]):
        assert (batched["path"], per_row["path"]) == ("batched", "per_row")
        assert (batched["repack_launches"], per_row["repack_launches"]) == (1, 3)
        assert batched["moved_tokens"] == per_row["moved_tokens"] > 0
        assert batched["speedup_vs_per_row"] > 0
    assert "| smollm2 | random | 16 | 3 |" in proc.stderr


def test_an_unknown_policy_is_refused_naming_the_flag():
    proc = evict_step("--device", "cpu", "--policies", "lru", timeout=120)
    assert proc.returncode == 2 and "--policies" in proc.stderr and "streamingllm" in proc.stderr
