"""repack_kv_ with RoPE re-rotation: moved keys re-rotated to their new positions (fp32 exact,
half precision within one ulp), against the torch reference and the rotation itself."""

import pytest
import torch
from kvtest_helpers import (
    assert_same_bytes,
    bufs,
    disjoint_moves,
    rope_cache,
    run_both,
    ulp_distance,
)

from sgl_vtoken.kernels import RopeShift, repack_kv_


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dim,rot_dim", [(64, 64), (80, 32)])  # full and partial rotary
@pytest.mark.parametrize("delta_dtype", [torch.int32, torch.int64])
def test_rope_fp32_exact(device, neox, dim, rot_dim, delta_dtype):
    g = torch.Generator().manual_seed(dim + rot_dim + neox)
    keys = [torch.randn(40, 3, dim, generator=g).to(device) for _ in range(2)]
    values = [torch.randn(40, 3, dim, generator=g).to(device) for _ in range(2)]
    src, dst = disjoint_moves(40, 9, torch.int64, g, device)
    delta = torch.tensor([-7, -1, 0, 3, -30, 12, -2, 5, -1], dtype=delta_dtype, device=device)
    rope = RopeShift(delta, rope_cache(64, rot_dim).to(device), neox=neox)
    k_exp, v_exp = run_both(keys, values, src, dst, rope=rope, check=True, block_moves=4)
    assert_same_bytes(keys, k_exp, "k")  # exact: same fp32 operations, no fma contraction
    assert_same_bytes(values, v_exp, "v")  # V is copied, never rotated


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_half_precision_within_one_ulp(device, dtype):
    g = torch.Generator().manual_seed(11)
    keys = [torch.randn(32, 2, 64, generator=g).to(dtype).to(device) for _ in range(2)]
    values = [torch.randn(32, 2, 64, generator=g).to(dtype).to(device) for _ in range(2)]
    src, dst = disjoint_moves(32, 8, torch.int32, g, device)
    delta = torch.tensor([-3, -1, 2, 0, -9, 4, -20, 1], device=device)
    rope = RopeShift(delta, rope_cache(32, 64).to(device))
    k_exp, v_exp = run_both(keys, values, src, dst, rope=rope)
    # the interpreter truncates fp32 -> bf16/fp16 where torch rounds to nearest even
    assert max(ulp_distance(a, b) for a, b in zip(keys, k_exp)) <= 1
    assert_same_bytes(values, v_exp, "v")


@pytest.mark.parametrize("neox", [True, False])
def test_rope_shift_moves_keys_to_their_new_positions(device, neox):
    """A key cached at position p, re-rotated by delta, equals the key rotated at p + delta."""
    g = torch.Generator().manual_seed(4)
    from sgl_vtoken.kernels.reference import rope_cos_sin_ref, rope_rotate_ref

    cache = rope_cache(128, 32, dtype=torch.float64)
    k_raw = torch.randn(6, 2, 32, generator=g, dtype=torch.float64)
    old = torch.tensor([40, 41, 70, 99, 100, 127])
    new = torch.tensor([4, 5, 6, 7, 8, 9])
    k_old = rope_rotate_ref(k_raw, *rope_cos_sin_ref(old, cache), neox)
    k_new = rope_rotate_ref(k_raw, *rope_cos_sin_ref(new, cache), neox)
    keys = [torch.zeros(16, 2, 32, dtype=torch.float32, device=device)]
    values = [torch.zeros(16, 2, 32, dtype=torch.float32, device=device)]
    keys[0][:6] = k_old.float().to(device)
    src = torch.arange(6, device=device)
    dst = torch.arange(10, 16, device=device)
    rope = RopeShift((new - old).to(device), cache.float().to(device), neox=neox)
    repack_kv_(keys, values, src, dst, rope=rope, impl="triton")
    torch.testing.assert_close(keys[0][10:16].cpu().double(), k_new, rtol=0, atol=2e-5)


@pytest.mark.parametrize(
    "rope_kw,dtype,match",
    [
        (dict(cs=rope_cache(8, 6)), torch.float8_e4m3fn, r"k_buffers\[0\] \(with rope\) has dtype"),
        (
            dict(cs=rope_cache(8, 10)),
            torch.float16,
            r"rot_dim 10; it must be even and in \[2, head_dim=8\]",
        ),
        (dict(cs=rope_cache(8, 6)[:, :5]), torch.float16, "rot_dim 5"),
        (
            dict(cs=rope_cache(8, 6), delta=torch.tensor([1, 2, 3])),
            torch.float16,
            "rope.delta has 3 entries",
        ),
        (
            dict(cs=rope_cache(4, 6), delta=torch.tensor([1, -4])),
            torch.float16,
            r"rope.delta reaches \|4\|",
        ),
    ],
)
def test_invalid_rope_arguments(device, rope_kw, dtype, match):
    k, v = bufs(device, dtype=dtype), bufs(device, dtype=dtype)
    delta = rope_kw.get("delta", torch.tensor([1, -1])).to(device)
    rope = RopeShift(delta, rope_kw["cs"].to(device))
    with pytest.raises(ValueError, match=match):
        repack_kv_(
            k,
            v,
            torch.tensor([1, 2], device=device),
            torch.tensor([3, 4], device=device),
            rope=rope,
            check=True,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False])
def test_gpu_rope_fp32_exact(device, neox):
    g = torch.Generator().manual_seed(8)
    keys = [torch.randn(4096, 8, 128, generator=g).to(device) for _ in range(4)]
    values = [torch.randn(4096, 8, 128, generator=g).to(device) for _ in range(4)]
    src, dst = disjoint_moves(4096, 1500, torch.int64, g, device)
    delta = torch.randint(-4000, 4000, (1500,), generator=g).to(device)
    rope = RopeShift(delta, rope_cache(4096, 128).to(device), neox=neox)
    k_exp, v_exp = run_both(keys, values, src, dst, rope=rope)
    torch.cuda.synchronize()
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")
