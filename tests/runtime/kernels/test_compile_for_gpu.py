"""Every kernel compiles for a real GPU (sm_90), checked on a CPU-only machine.

The interpreter runs kernels as Python, so code can pass every CPU test and still fail to compile
(types of loop-carried values, constexpr misuse). A subprocess with TRITON_INTERPRET unset compiles
each kernel ahead of time for an H100/H200 target and inspects the PTX and the cubin for the
properties the design relies on: no register spills (ptxas stack frames), 128-bit vector copies
and two barriers per chunk in the repacker, no fma contraction in the RoPE path (bit-exact against
the torch reference), tensor-core logits in the score kernel and atomics only where it accumulates.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, os, re, subprocess, tempfile
    import triton, triton.language as tl
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sgl_vtoken.kernels.repack import _repack_kernel
    from sgl_vtoken.kernels.page_index import _page_indptr_kernel, _page_ids_kernel
    from sgl_vtoken.kernels.attn_scores import _attn_scores_kernel

    TARGET = GPUTarget("cuda", 90, 32)
    CUOBJDUMP = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")

    def stack_bytes(cubin):
        # ptxas spills go to the stack frame, which only the cubin shows (-1: tool unavailable)
        if not os.path.exists(CUOBJDUMP):
            return -1
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"STACK:(\d+)", out)
        return int(m.group(1)) if m else -1

    def compile_(fn, types, const, aligned=(), **options):
        # types: every runtime argument's Triton type; aligned: args specialized as 16-divisible
        names = fn.arg_names
        missing = set(names) - set(types) - set(const)
        assert not missing, f"{fn.__name__}: no type for {sorted(missing)} (kernel signature changed?)"
        sig = {n: ("constexpr" if n in const else types[n]) for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        asm = triton.compile(src, target=TARGET, options=options).asm
        ptx = asm["ptx"]
        keys = (r"ld\.global\.v4", r"st\.global\.v4", r"bar\.sync", r"fma\.rn\.f32", r"ld\.local", r"atom\.", r"mma", r"cp\.async")
        return dict({k: len(re.findall(k, ptx)) for k in keys}, stack=stack_bytes(asm["cubin"]))

    REPACK = dict(k_table="*i64", v_table="*i64", src_ptr="*i64", dst_ptr="*i32", num_moves="i32",
                  stride_ks="i64", stride_kh="i64", stride_vs="i64", stride_vh="i64",
                  delta_ptr="*i64", cos_sin_ptr="*fp32", stride_cs="i32")
    ALIGNED = ("k_table", "v_table", "src_ptr", "dst_ptr", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "cos_sin_ptr", "stride_cs")
    OPTS = dict(num_warps=4, num_stages=1, enable_fp_fusion=False)
    out = {}
    # the default launch for Llama-3.1-8B bf16 (whole heads, 128 moves) and the same bytes in fp8 / head_dim 64
    out["repack_bf16_default"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=128, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_fp8_default"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.uint8, V_DTYPE=tl.uint8, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=256, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_d64_default"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=64, BLOCK_D=64, PARTS=1, BLOCK_M=256, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_bf16"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=64, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_bf16_split"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=64, PARTS=2, BLOCK_M=128, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_fp8"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.uint8, V_DTYPE=tl.uint8, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=128, ROPE=False, ROT_DIM=2, NEOX=True), ALIGNED, **OPTS)
    out["repack_odd"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.int32, V_DTYPE=tl.int32, HAS_V=False, D=80, BLOCK_D=32, PARTS=3, BLOCK_M=32, ROPE=False, ROT_DIM=2, NEOX=True), (), **OPTS)
    out["repack_rope_neox"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.bfloat16, V_DTYPE=tl.int16, HAS_V=True, D=128, BLOCK_D=128, PARTS=1, BLOCK_M=16, ROPE=True, ROT_DIM=128, NEOX=True), ALIGNED, **OPTS)
    out["repack_rope_gptj"] = compile_(_repack_kernel, REPACK, dict(K_DTYPE=tl.float32, V_DTYPE=tl.int32, HAS_V=True, D=80, BLOCK_D=128, PARTS=1, BLOCK_M=16, ROPE=True, ROT_DIM=32, NEOX=False), ALIGNED, **OPTS)
    out["page_indptr"] = compile_(_page_indptr_kernel, dict(seq_lens_ptr="*i64", bs="i32", kv_indptr_ptr="*i32", last_page_len_ptr="*i32"), dict(PAGE=16, BLOCK_B=1024))
    out["page_ids"] = compile_(_page_ids_kernel, dict(req_to_token_ptr="*i32", stride_row="i32", stride_col="i32", req_pool_indices_ptr="*i64", seq_lens_ptr="*i64", kv_indptr_ptr="*i32", kv_indices_ptr="*i32"), dict(PAGE=16, BLOCK_P=128, SPLITS=4))
    ATT = dict(q_ptr="*bf16", stride_qb="i32", stride_qh="i32", k_ptr="*bf16", stride_ks="i64", stride_kh="i32", kv_indptr_ptr="*i32", kv_indices_ptr="*i32")
    SC = dict(ATT, lse_ptr="*fp32", stride_lb="i32", stride_lh="i32", qk_scale="fp32", lse_scale="fp32", decay="fp32", num_splits="i32", part_ptr="*fp32", score_ptr="*fp32", stride_ss="i32", stride_sh="i32")
    SC_ALIGNED = ("q_ptr", "k_ptr", "stride_ks", "stride_kh", "kv_indices_ptr", "part_ptr", "score_ptr")
    LLAMA8B = dict(HQ=32, HKV=8, GROUP=4, HQ_PAD=32, HKV_PAD=8, D=128, BLOCK_D=128, BLOCK_N=16, UPCAST=False, PRECISION="tf32", BY_ENTRY=False)
    for per_head in (False, True):
        for mode in (0, 1, 2):
            out[f"scores_{int(per_head)}{mode}"] = compile_(_attn_scores_kernel, SC, dict(LLAMA8B, PASS=1, LSE_GIVEN=True, PER_HEAD=per_head, MODE=mode), SC_ALIGNED, num_warps=4)
    out["scores_lse_pass"] = compile_(_attn_scores_kernel, SC, dict(LLAMA8B, PASS=0, LSE_GIVEN=False, PER_HEAD=True, MODE=2), SC_ALIGNED, num_warps=4)
    out["scores_merged_lse"] = compile_(_attn_scores_kernel, SC, dict(LLAMA8B, PASS=1, LSE_GIVEN=False, PER_HEAD=True, MODE=2), SC_ALIGNED, num_warps=4)
    # SmolLM2-135M (3 KV heads padded to 4, head_dim 64), fp32 (ieee dot), odd head_dim 80 in fp16
    out["scores_smollm2"] = compile_(_attn_scores_kernel, SC, dict(HQ=9, HKV=3, GROUP=3, HQ_PAD=16, HKV_PAD=4, D=64, BLOCK_D=64, BLOCK_N=64, PASS=1, LSE_GIVEN=True, PER_HEAD=True, BY_ENTRY=False, MODE=2, UPCAST=False, PRECISION="tf32"), SC_ALIGNED, num_warps=4)
    # the server's decode scoring: per KV head, indexed by entry (no atomics), with and without the LSE
    out["scores_entry"] = compile_(_attn_scores_kernel, SC, dict(LLAMA8B, PASS=1, LSE_GIVEN=True, PER_HEAD=True, BY_ENTRY=True, MODE=2), SC_ALIGNED, num_warps=4)
    out["scores_entry_merged_lse"] = compile_(_attn_scores_kernel, SC, dict(LLAMA8B, PASS=1, LSE_GIVEN=False, PER_HEAD=True, BY_ENTRY=True, MODE=2), SC_ALIGNED, num_warps=4)
    out["scores_fp32"] = compile_(_attn_scores_kernel, dict(SC, q_ptr="*fp32", k_ptr="*fp32"), dict(LLAMA8B, BLOCK_N=4, PASS=1, LSE_GIVEN=True, PER_HEAD=False, MODE=1, UPCAST=True, PRECISION="ieee"), SC_ALIGNED, num_warps=4)
    out["scores_d80_fp16"] = compile_(_attn_scores_kernel, dict(SC, q_ptr="*fp16", k_ptr="*fp16"), dict(LLAMA8B, D=80, BLOCK_N=16, PASS=1, LSE_GIVEN=True, PER_HEAD=True, MODE=0), (), num_warps=4)
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
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    return json.loads(line.removeprefix("RESULT"))


def test_all_kernels_compile_for_sm90_without_spills(ptx_stats):
    assert len(ptx_stats) == 24
    for name, stats in ptx_stats.items():
        assert stats[r"ld\.local"] == 0, f"{name} spills registers to local memory"
        assert stats["stack"] <= 0, f"{name}: ptxas spills {stats['stack']} bytes to the stack"


@pytest.mark.parametrize(
    "name",
    [
        "repack_bf16_default",
        "repack_fp8_default",
        "repack_d64_default",
        "repack_bf16",
        "repack_bf16_split",
        "repack_fp8",
    ],
)
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
    assert ptx_stats["scores_entry"][r"atom\."] == 0


@pytest.mark.parametrize(
    "name",
    [
        "scores_00",
        "scores_11",
        "scores_lse_pass",
        "scores_merged_lse",
        "scores_smollm2",
        "scores_entry",
        "scores_entry_merged_lse",
    ],
)
def test_score_logits_use_tensor_cores_and_async_copies(ptx_stats, name):
    """16-bit K: logits by mma/wgmma, K tiles gathered by cp.async into shared memory (pipelined)."""
    assert ptx_stats[name][r"mma"] > 0, ptx_stats[name]
    assert ptx_stats[name][r"cp\.async"] > 0, ptx_stats[name]
