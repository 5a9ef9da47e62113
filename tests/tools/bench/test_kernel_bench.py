"""The kernel benchmark end to end at smoke shapes on CPU (the GPU run's dry mode), its move
patterns, and its host-cost probe (no timed assertions)."""

import json
import os

import pytest
import torch

from sgl_vtoken.kernels import repack
from sgl_vtoken.kernels.repack_api import check_moves
from sgl_vtoken_tools import kernel_bench as bench

# --cpu-smoke runs Triton on CPU tensors: only where the kernels were loaded by the interpreter
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.fixture(scope="module")
def cli(command):
    return command("kernels")


@pytest.mark.parametrize("pattern", ["compaction", "scatter"])
def test_move_patterns_satisfy_the_in_place_precondition(pattern):
    g = torch.Generator().manual_seed(0)
    src, dst = bench.repack_moves(pattern, 300, 4096, 16, g)
    assert src.numel() == dst.numel() == 300
    check_moves(src, dst, 4096)  # raises if a move reads a slot an earlier move wrote
    assert bool((src != dst).all())


def test_no_launch_stubs_the_kernel_and_restores_it():
    kernel = repack._repack_kernel
    with bench.no_launch(repack):
        assert repack._repack_kernel is not kernel
        assert type(repack._repack_kernel).__name__ == type(kernel).__name__
        repack._repack_kernel[(1, 1)](1, 2, x=3)  # a launch does nothing
    assert repack._repack_kernel is kernel


def test_smoke_run_writes_every_part_and_a_summary(cli, tmp_path):
    out = tmp_path / "b.jsonl"
    rc = cli.main(["--cpu-smoke", "--sweep", "--tokens", "48", "--patterns", "compaction", "--score-shapes", "2x40",
                   "--out", str(out)])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0 and not [r for r in rows if "error" in r or "skipped" in r]
    kinds = {(r["kernel"], r.get("impl"), r.get("sweep", False)) for r in rows}
    assert {("repack_kv", "triton", False), ("repack_kv", "torch", False), ("repack_kv", "triton", True),
            ("attn_scores", "triton", False), ("attn_scores", "triton", True), ("page_indices", "triton", False),
            ("d2d_copy", None, False)} <= kinds  # fmt: skip
    host = next(r for r in rows if r.get("part") == "host_overhead")
    assert host["buffers"] == 64 and host["cached_us"] > 0  # Llama-3.1-8B layer count, even on CPU
    scores = [r for r in rows if r["kernel"] == "attn_scores" and "time_us" in r]
    assert {(r["lse_given"], r["per_head"]) for r in scores} >= {
        (True, False),
        (False, False),
        (True, True),
    }
    text = cli.summarize(rows)
    assert "repack_kv_ host cost" in text and "sweep" in text and "0 errors" in text


def test_a_failing_measurement_is_recorded_and_the_run_goes_on(cli, tmp_path, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "repack_host_overhead", broken)
    out = tmp_path / "b.jsonl"
    rc = cli.main(["--cpu-smoke", "--parts", "host,page_indices", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1
    assert rows[0]["error"] == "RuntimeError: boom" and any(
        r["kernel"] == "page_indices" for r in rows
    )
