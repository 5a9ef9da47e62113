"""The overhead baseline: SGLang without sgl-vtoken, plus only its CPU fix."""

import subprocess
import sys

from sgl_vtoken_tools.bench import baseline
from sgl_vtoken_tools.bench.server_log import error_lines


def test_shim_trace_is_counted_per_process():
    shim = f"{baseline.SHIM_MARK} sglang.srt.layers.rotary_embedding.base._is_cpu = True (pid 7)\n"
    assert baseline.shim_applications("Decode batch, #running-req: 3\n" + shim * 3) == 3
    assert baseline.shim_applications("Decode batch, #running-req: 3\n") == 0
    assert error_lines(shim) == []


def test_shim_sets_the_cpu_flag_in_a_fresh_interpreter(tmp_path):
    """The baseline's sitecustomize, on PYTHONPATH, sets `_is_cpu` once the module loads."""
    (tmp_path / "sitecustomize.py").write_text(baseline.SHIM_SOURCE)
    code = "import sglang.srt.layers.rotary_embedding.base as b; print(b._is_cpu)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"
    assert baseline.shim_applications(out.stderr) == 1


def test_baseline_whitelist_leaves_out_only_sgl_vtoken():
    assert baseline.baseline_plugin_whitelist("none") == "__none__"
    names = baseline.baseline_plugin_whitelist("others").split(",")
    assert baseline.PLUGIN_ENTRY_POINT not in names and all(names)


def test_baseline_env_puts_the_shim_first_and_removes_it(monkeypatch):
    import os
    from pathlib import Path

    from sgl_vtoken_tools.bench.baseline import SHIM_SOURCE, baseline_env

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with baseline_env("none") as env:
        shim, rest = env["PYTHONPATH"].split(os.pathsep)
        assert (Path(shim) / "sitecustomize.py").read_text() == SHIM_SOURCE and rest == "/elsewhere"
        assert env["SGLANG_PLUGINS"] == "__none__"
    assert not Path(shim).exists()
