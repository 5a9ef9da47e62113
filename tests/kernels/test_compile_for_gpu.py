"""Every kernel compiles for a real GPU (sm_90 PTX), checked on a CPU-only machine.

The interpreter runs kernels as Python, so code can pass every CPU test and still fail to compile
(types of loop-carried values, constexpr misuse). A subprocess with TRITON_INTERPRET unset compiles
each kernel ahead of time for an H100/H200 target and inspects the PTX for the properties the
design relies on: 128-bit vector copies and two barriers per chunk in the repacker, no fma
contraction in the RoPE path (bit-exact against the torch reference).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, os, re
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sgl_vtoken.kernels.repack import _repack_kernel
    from sgl_vtoken.kernels.page_index import _page_indptr_kernel, _page_ids_kernel
    from sgl_vtoken.kernels.attn_scores import _lse_kernel, _attn_scores_kernel

    TARGET = GPUTarget("cuda", 90, 32)

    def compile_(fn, types, const, aligned=(), **options):
        # types: every runtime argument's Triton type; aligned: args specialized as 16-divisible
        names = fn.arg_names
        missing = set(names) - set(types) - set(const)
        assert not missing, f"{fn.__name__}: no type for {sorted(missing)} (kernel signature changed?)"
        sig = {n: ("constexpr" if n in const else types[n]) for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        ptx = triton.compile(src, target=TARGET, options=options).asm["ptx"]
        return {k: len(re.findall(k, ptx)) for k in (r"ld\.global\.v4", r"st\.global\.v4", r"bar\.sync", r"fma\.rn\.f32", r"ld\.local", r"atom\.")}

    REPACK = dict(k_table="*i64", v_table="*i64", src_ptr="*i64", dst_ptr="*i32", num_moves="i32",
                  stride_ks="i64", stride_kh="i64", stride_vs="i64", stride_vh="i64",
                  delta_ptr="*i64", cos_sin_ptr="*fp32", stride_cs="i32")
    ALIGNED = ("k_table", "v_table", "src_ptr", "dst_ptr", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "cos_sin_ptr", "stride_cs")
    OPTS = dict(num_warps=4, num_stages=1, enable_fp_fusion=False)
    out = {}
    out["repack_bf16"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=64, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_bf16_split"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=64, PARTS=2, BLOCK_M=128, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_fp8"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.uint8, V_DTYPE=tl.uint8, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=128, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_odd"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int32, V_DTYPE=tl.int32, HAS_V=False, D=80, BLOCK_D=32, PARTS=3, BLOCK_M=32, ROPE=False, ROT_DIM=2, NEOX=True), (), **OPTS)
    out["repack_rope_neox"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.bfloat16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=16, ROPE=True, ROT_DIM=128, NEOX=True), ALIGNED, **OPTS)
    out["repack_rope_gptj"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.float32, V_DTYPE=tl.int32, HAS_V=True, D=80, BLOCK_D=128, PARTS=1, BLOCK_M=16, ROPE=True, ROT_DIM=32, NEOX=False), ALIGNED, **OPTS)
    out["page_indptr"] = compile_(_page_indptr_kernel, dict(seq_lens_ptr="*i64", bs="i32", kv_indptr_ptr="*i32", last_page_len_ptr="*i32"), dict(PAGE=16, BLOCK_B=1024))
    out["page_ids"] = compile_(_page_ids_kernel, dict(req_to_token_ptr="*i32", stride_row="i32", stride_col="i32", req_pool_indices_ptr="*i64", seq_lens_ptr="*i64", kv_indptr_ptr="*i32", kv_indices_ptr="*i32"), dict(PAGE=16, BLOCK_P=128, SPLITS=4))
    ATT = dict(q_ptr="*bf16", stride_qb="i32", stride_qh="i32", k_ptr="*bf16", stride_ks="i64", stride_kh="i32", kv_indptr_ptr="*i32", kv_indices_ptr="*i32")
    out["lse"] = compile_(_lse_kernel, dict(ATT, sm_scale="fp32", lse_ptr="*fp32"), dict(HQ=32, GROUP=4, D=128, BLOCK_D=128, BLOCK_N=64), ("q_ptr", "k_ptr", "stride_ks", "stride_kh"))
    SC = dict(ATT, lse_ptr="*fp32", stride_lb="i32", stride_lh="i32", sm_scale="fp32", lse_scale="fp32", decay="fp32", num_splits="i32", score_ptr="*fp32", stride_ss="i32", stride_sh="i32")
    for per_head in (False, True):
        for mode in (0, 1, 2):
            out[f"scores_{int(per_head)}{mode}"] = compile_(_attn_scores_kernel, SC, dict(HKV=8, GROUP=4, D=128, BLOCK_D=128, BLOCK_N=64, PER_HEAD=per_head, MODE=mode), ("q_ptr", "k_ptr", "stride_ks", "stride_kh"))
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ptx_stats():
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        pytest.skip("triton without the NVIDIA backend")
    if not os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")):
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def test_all_kernels_compile_for_sm90_without_spills(ptx_stats):
    assert len(ptx_stats) == 15
    for name, stats in ptx_stats.items():
        assert stats[r"ld\.local"] == 0, f"{name} spills registers to local memory"


@pytest.mark.parametrize("name", ["repack_bf16", "repack_bf16_split", "repack_fp8"])
def test_repack_copies_with_128_bit_accesses_and_chunk_barriers(ptx_stats, name):
    stats = ptx_stats[name]
    assert stats[r"ld\.global\.v4"] > 0 and stats[r"st\.global\.v4"] > 0, stats
    assert stats[r"bar\.sync"] >= 2, stats  # read-all-then-write-all per chunk


@pytest.mark.parametrize("name", ["repack_rope_neox", "repack_rope_gptj"])
def test_repack_rope_has_no_fma_contraction(ptx_stats, name):
    assert ptx_stats[name][r"fma\.rn\.f32"] == 0


def test_scores_accumulate_atomically_only_when_decay_is_one(ptx_stats):
    for per_head in (0, 1):
        assert ptx_stats[f"scores_{per_head}0"][r"atom\."] > 0
        assert ptx_stats[f"scores_{per_head}1"][r"atom\."] == 0
        assert ptx_stats[f"scores_{per_head}2"][r"atom\."] == 0
