"""scripts/bench_eviction.py: its log parsing (scripts/server_probe.py) on hand-written SGLang log text and its
baseline server (scripts/baseline_server.py); no server started."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "bench_eviction.py"


def load(name: str):
    """A module of scripts/ (which import each other by bare name, as when run as scripts)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def probe():
    return load("server_probe")


@pytest.fixture(scope="module")
def baseline():
    return load("baseline_server")


# Shaped like SGLang 0.5.23's scheduler output (metrics_reporter.py, scheduler.py).
SAMPLE_LOG = """\
[2026-12-01 10:00:01] Prefill batch, #new-seq: 3, #new-token: 144, #cached-token: 0, token usage: 0.04, #running-req: 0, #queue-req: 13,
[2026-12-01 10:00:02] Decode batch, #running-req: 3, #token: 208, token usage: 0.05, gen throughput (token/s): 310.22, #queue-req: 13,
[2026-12-01 10:00:03] Decode batch [412], #running-req: 12, #token: 3900, token usage: 0.95, gen throughput (token/s): 990.10, #queue-req: 4,
[2026-12-01 10:00:03] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 2048, #new_token_ratio: 0.4100 -> 0.7000
[2026-12-01 10:00:04] Decode batch, #running-req: 10, #token: 3000, token usage: 0.73, gen throughput (token/s): 805.00, #queue-req: 6,
[2026-12-01 10:00:04] Testing retraction. #retracted_reqs: 1, #new_tokens_gained: 64
[2026-12-01 10:00:05] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 1024, #new_token_ratio: 0.6000 -> 0.9000
[2026-12-01 10:00:06] Decode batch, #running-req: 9, #token: 2900, token usage: 0.70, gen throughput (token/s): 700.00, #queue-req: 7,
"""


def test_peak_running_is_the_largest_decode_batch(probe):
    assert probe.peak_running_from_log(SAMPLE_LOG) == 12  # the "[iter]" form counts too
    # The prefill line's "#running-req: 0" is not a decode batch; neither is a "#running-req: 99"
    # elsewhere in a line that is not a Decode batch record.
    assert probe.peak_running_from_log("Prefill batch, #running-req: 99, #queue-req: 0,\n") is None
    assert probe.peak_running_from_log("") is None
    assert probe.peak_running_from_log("Decode batch, #running-req: 1, #token: 5,\n") == 1


def test_retractions_count_only_the_pool_full_lines(probe):
    assert probe.count_retractions(SAMPLE_LOG) == 2  # "Testing retraction." is not one
    assert probe.retracted_requests(SAMPLE_LOG) == 3
    assert probe.count_retractions("Decode batch, #running-req: 3,\n") == 0
    assert probe.retracted_requests("") == 0


def test_error_lines_and_shim_trace(probe, baseline):
    text = SAMPLE_LOG + "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom\n"
    assert probe.error_lines(text) == ["Traceback (most recent call last):", "ValueError: boom"]
    assert probe.error_lines(SAMPLE_LOG) == []
    shim = f"{baseline.SHIM_MARK} sglang.srt.layers.rotary_embedding.base._is_cpu = True (pid 7)\n"
    assert baseline.shim_applications(SAMPLE_LOG + shim * 3) == 3
    assert baseline.shim_applications(SAMPLE_LOG) == 0


def test_shim_sets_the_cpu_flag_in_a_fresh_interpreter(baseline, tmp_path):
    """The baseline's sitecustomize, on PYTHONPATH, sets `_is_cpu` once the module loads."""
    (tmp_path / "sitecustomize.py").write_text(baseline.SHIM_SOURCE)
    code = "import sglang.srt.layers.rotary_embedding.base as b; print(b._is_cpu)"
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
    assert baseline.shim_applications(out.stderr) == 1


def test_help_runs_without_sglang_imports():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--part" in out.stdout and "--quick" in out.stdout


def test_baseline_whitelist_leaves_out_only_sgl_vtoken(baseline):
    assert baseline.baseline_plugin_whitelist("none") == "__none__"
    names = baseline.baseline_plugin_whitelist("others").split(",")
    assert baseline.PLUGIN_ENTRY_POINT not in names and all(names)
