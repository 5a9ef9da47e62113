"""repack_kv_: Triton (interpreted on CPU, compiled on GPU) against the torch reference, byte for byte
(RoPE re-rotation: test_repack_rope.py)."""

import pytest
import torch
from kvtest_helpers import (
    assert_same_bytes,
    bufs,
    compaction_moves,
    disjoint_moves,
    page_dense_rows,
    random_bytes,
    random_layers,
    raw,
    run_both,
)

from sgl_vtoken.kernels import repack_kv_, repack_kv_ref_

COPY_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]


@pytest.mark.parametrize("dtype", COPY_DTYPES)
@pytest.mark.parametrize("heads,dim", [(2, 64), (3, 80), (1, 96)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_copy_matches_reference_bytewise(device, dtype, heads, dim, idx_dtype):
    """Every K and V layer gets dst rows = old src rows; all other bytes are untouched."""
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    keys = random_layers(3, 48, heads, dim, dtype, g, device)
    values = random_layers(3, 48, heads, dim, dtype, g, device)
    src, dst = disjoint_moves(48, 13, idx_dtype, g, device)
    before = [raw(t).clone() for t in keys + values]
    k_exp, v_exp = run_both(keys, values, src, dst, block_moves=4)
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")
    # what users rely on: dst rows hold the old src rows, every other row is untouched
    s, d = src.long(), dst.long()
    untouched = torch.ones(48, dtype=torch.bool, device=device)
    untouched[d] = False
    for t, t0 in zip(keys + values, before):
        assert torch.equal(raw(t)[d], t0[s])
        assert torch.equal(raw(t)[untouched], t0[untouched])


@pytest.mark.parametrize("block_moves", [2, 4, 32])
def test_reference_semantics_gather_then_scatter(device, block_moves):
    """With chains (a destination that a later move reads), results equal buf[dst] = old buf[src]."""
    g = torch.Generator().manual_seed(block_moves)
    keys = random_layers(2, 32, 2, 16, torch.bfloat16, g, device)
    values = random_layers(2, 32, 2, 16, torch.bfloat16, g, device)
    before_k = [t.clone() for t in keys]
    # shift-left chain: slot 9 -> 8, 10 -> 9, ..., 20 -> 19 (every dst except the first is read earlier)
    src = torch.arange(9, 21, device=device)
    dst = src - 1
    repack_kv_(keys, values, src, dst, impl="triton", check=True, block_moves=block_moves)
    for k, k0 in zip(keys, before_k):
        assert torch.equal(raw(k[8:20]), raw(k0[9:21]))
        assert torch.equal(raw(k[20:]), raw(k0[20:])) and torch.equal(raw(k[:8]), raw(k0[:8]))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("block_moves", [4, 16])
def test_in_place_compaction_of_page_dense_rows(device, page_size, block_moves):
    """The planner's compaction (dst <= src per row, rows in a batch) repacks exactly like the reference.

    Row lengths cover a single page, one page plus one token, and several pages; keep masks are
    random, plus a row that drops only its first private token (every later token moves one slot).
    """
    g = torch.Generator().manual_seed(page_size * 10 + block_moves)
    lens = [page_size, page_size + 1, 3 * page_size + 2, 5 * page_size, 4 * page_size + 3]
    rows = page_dense_rows(page_size, lens, num_pages=64 if page_size > 1 else 256, g=g)
    starts = [0, 0, page_size, 0, 0]
    keeps = [(torch.rand(n - s, generator=g) < 0.6).tolist() for n, s in zip(lens, starts)]
    keeps[-1] = [False] + [True] * (lens[-1] - starts[-1] - 1)
    src, dst = compaction_moves(rows, keeps, starts)
    assert src, "the fixture must produce moves"
    num_slots = (64 if page_size > 1 else 256) * page_size
    keys = random_layers(2, num_slots, 2, 24, torch.float16, g, device)
    values = random_layers(2, num_slots, 2, 24, torch.float16, g, device)
    src_t = torch.tensor(src, dtype=torch.int32, device=device)
    dst_t = torch.tensor(dst, dtype=torch.int32, device=device)
    k_exp, v_exp = run_both(keys, values, src_t, dst_t, check=True, block_moves=block_moves)
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")


@pytest.mark.parametrize("col_block", [8, 32, 128])
def test_column_split_matches_reference(device, col_block):
    """Heads split into column parts (the last one partial: head_dim 80), with in-place chains."""
    g = torch.Generator().manual_seed(col_block)
    keys = random_layers(2, 40, 3, 80, torch.bfloat16, g, device)
    values = random_layers(2, 40, 3, 80, torch.bfloat16, g, device)
    src = torch.tensor([3, 5, 6, 7, 9, 10, 30], device=device)
    dst = torch.tensor([2, 3, 4, 5, 6, 7, 8], device=device)
    k_exp, v_exp = run_both(keys, values, src, dst, check=True, block_moves=2, col_block=col_block)
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")


def test_col_block_must_be_a_power_of_two(device):
    k, v = bufs(device), bufs(device)
    with pytest.raises(ValueError, match="col_block must be a power of 2, got 24"):
        repack_kv_(
            k,
            v,
            torch.tensor([1], device=device),
            torch.tensor([2], device=device),
            impl="triton",
            col_block=24,
        )


def test_compaction_reference_keeps_kept_tokens_in_row_order(device):
    """Oracle check on the reference itself: after compaction row[start + k] holds the k-th kept token."""
    g = torch.Generator().manual_seed(5)
    rows = page_dense_rows(4, [10], num_pages=8, g=g)
    keep = [True, False, False, True, True, False, True, True, False, True]
    src, dst = compaction_moves(rows, [keep], [0])
    keys = random_layers(1, 32, 1, 8, torch.float32, g, device)
    values = random_layers(1, 32, 1, 8, torch.float32, g, device)
    before = raw(keys[0]).clone()
    repack_kv_(
        keys,
        values,
        torch.tensor(src, device=device),
        torch.tensor(dst, device=device),
        impl="triton",
    )
    kept_slots = [s for s, k in zip(rows[0], keep) if k]
    for k, slot in enumerate(kept_slots):
        assert torch.equal(raw(keys[0])[rows[0][k]], before[slot])


def test_empty_move_list_is_a_no_op(device):
    g = torch.Generator().manual_seed(0)
    keys = random_layers(2, 8, 1, 16, torch.bfloat16, g, device)
    values = random_layers(2, 8, 1, 16, torch.bfloat16, g, device)
    before = [t.clone() for t in keys + values]
    empty = torch.empty(0, dtype=torch.int64, device=device)
    for impl in ("triton", "torch"):
        repack_kv_(keys, values, empty, empty, impl=impl, check=True)
    assert_same_bytes(keys + values, before)


def test_stacked_tensor_and_head_dim_slice_views(device):
    """A 4-D stacked cache and non-contiguous views (head_dim slice, slot stride 2) work; bytes
    outside the views stay untouched."""
    g = torch.Generator().manual_seed(1)
    full_k = random_bytes((3, 64, 4, 160), torch.bfloat16, g, device)
    full_v = random_bytes((3, 64, 4, 160), torch.bfloat16, g, device)
    k, v = (
        full_k[:, ::2, :, :100],
        full_v[:, ::2, :, :100],
    )  # [3, 32, 4, 100], strides (.., 1280, 160, 1)
    src, dst = disjoint_moves(32, 9, torch.int64, g, device)
    fk_exp, fv_exp = full_k.clone(), full_v.clone()
    repack_kv_(fk_exp[:, ::2, :, :100], fv_exp[:, ::2, :, :100], src, dst, impl="torch")
    repack_kv_(k, v, src, dst, impl="triton", block_moves=4)
    assert torch.equal(raw(full_k), raw(fk_exp)) and torch.equal(raw(full_v), raw(fv_exp))


def test_k_and_v_as_halves_of_one_buffer(device):
    """SGLang allocates K and V of a layer as two halves of one tensor: both halves move, nothing else."""
    g = torch.Generator().manual_seed(2)
    kv = [random_bytes((40, 2 * 3, 32), torch.float16, g, device) for _ in range(2)]
    keys, values = [t[:, :3] for t in kv], [t[:, 3:] for t in kv]
    src, dst = disjoint_moves(40, 7, torch.int32, g, device)
    exp = [t.clone() for t in kv]
    repack_kv_([t[:, :3] for t in exp], [t[:, 3:] for t in exp], src, dst, impl="torch")
    repack_kv_(keys, values, src, dst, impl="triton")
    assert_same_bytes(kv, exp)


def test_v_head_dim_different_from_k(device):
    g = torch.Generator().manual_seed(3)
    keys = random_layers(2, 30, 2, 48, torch.float16, g, device)
    values = random_layers(2, 30, 3, 40, torch.float16, g, device)
    src, dst = disjoint_moves(30, 6, torch.int64, g, device)
    k_exp, v_exp = run_both(keys, values, src, dst)
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_offsets_beyond_2_pow_31(device, idx_dtype):
    """slot * slot_stride exceeds 2**31 elements: the kernel must compute offsets in int64.

    The uint8 layer buffers reserve ~2.1 GB of address space each; only touched pages are committed.
    """
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 16 << 30:
        pytest.skip("needs ~5 GB of device memory")
    heads, dim = 1, 32
    num_slots = (1 << 31) // (heads * dim) + 64
    keys = [torch.empty((num_slots, heads, dim), dtype=torch.uint8, device=device)]
    values = [torch.empty((num_slots, heads, dim), dtype=torch.uint8, device=device)]
    hi = num_slots - 3
    row = torch.arange(dim, dtype=torch.uint8, device=device).view(1, dim)
    keys[0][hi], values[0][hi], keys[0][5], values[0][5] = row, row + 100, row + 1, row + 200
    src = torch.tensor([hi, 5], dtype=idx_dtype, device=device)
    dst = torch.tensor([7, hi - 1], dtype=idx_dtype, device=device)
    repack_kv_(keys, values, src, dst, impl="triton", check=True)
    assert torch.equal(keys[0][7], row) and torch.equal(values[0][7], row + 100)
    assert torch.equal(keys[0][hi - 1], row + 1) and torch.equal(values[0][hi - 1], row + 200)


# ----------------------------------------------------------------------------------------------
# dispatch and validation
# ----------------------------------------------------------------------------------------------
def test_default_impl_on_cpu_is_torch_and_matches():
    g = torch.Generator().manual_seed(6)
    keys = random_layers(2, 16, 1, 8, torch.float16, g, "cpu")
    values = random_layers(2, 16, 1, 8, torch.float16, g, "cpu")
    src, dst = disjoint_moves(16, 4, torch.int64, g, "cpu")
    k_exp = [t.clone() for t in keys]
    repack_kv_ref_(k_exp, [t.clone() for t in values], src, dst)
    repack_kv_(keys, values, src, dst)  # impl=None on CPU tensors: the reference
    assert_same_bytes(keys, k_exp)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda d: dict(impl="cuda"), "impl must be one of"),
        (lambda d: dict(k_buffers=[]), "k_buffers is empty"),
        (lambda d: dict(v_buffers=bufs(d, 3)), "k_buffers has 2 layers but v_buffers has 3"),
        (
            lambda d: dict(
                k_buffers=[bufs(d)[0], torch.zeros(16, 2, 9, dtype=torch.float16, device=d)]
            ),
            r"k_buffers\[1\] has shape",
        ),
        (
            lambda d: dict(k_buffers=bufs(d, dtype=torch.float64)),
            r"k_buffers\[0\] has dtype torch.float64",
        ),
        (
            lambda d: dict(k_buffers=[t.transpose(1, 2) for t in bufs(d, shape=(16, 8, 2))]),
            "contiguous last dimension",
        ),
        (lambda d: dict(v_buffers=bufs(d, shape=(15, 2, 8))), "v_buffers hold 15 slots"),
        (
            lambda d: dict(src=torch.zeros(2, dtype=torch.int16, device=d)),
            "src has dtype torch.int16",
        ),
        (
            lambda d: dict(dst=torch.zeros(3, dtype=torch.int64, device=d)),
            "dst has 3 entries, expected 2",
        ),
        (lambda d: dict(src=torch.zeros(1, 2, dtype=torch.int64, device=d)), "src must be 1-D"),
        (
            lambda d: dict(src=torch.tensor([3, 16], device=d), check=True),
            r"src holds slot ids in \[3, 16\]",
        ),
        (lambda d: dict(dst=torch.tensor([4, 4], device=d), check=True), "dst repeats a slot"),
        (
            lambda d: dict(
                src=torch.tensor([1, 5], device=d), dst=torch.tensor([5, 2], device=d), check=True
            ),
            "move 1 reads slot 5",
        ),
    ],
)
def test_invalid_arguments_name_the_argument(device, make, match):
    args = dict(
        k_buffers=bufs(device),
        v_buffers=bufs(device),
        src=torch.tensor([1, 2], device=device),
        dst=torch.tensor([3, 4], device=device),
    )
    args.update(make(device))
    with pytest.raises(ValueError, match=match):
        repack_kv_(
            args.pop("k_buffers"), args.pop("v_buffers"), args.pop("src"), args.pop("dst"), **args
        )


def test_aliased_buffers_are_rejected_for_triton(device):
    """Programs write different buffers concurrently, so buffers sharing bytes are refused."""
    one = torch.tensor([1], device=device)
    k = bufs(device)
    with pytest.raises(
        ValueError, match=r"k_buffers\[(\d)\] and v_buffers\[\1\] overlap in memory"
    ):
        repack_kv_(k, k, one, one + 1, impl="triton")
    wide = [torch.zeros(16, 3, 8, dtype=torch.float16, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match=r"overlap in memory"):  # heads 0-1 vs heads 1-2
        repack_kv_(
            [t[:, 0:2] for t in wide], [t[:, 1:3] for t in wide], one, one + 1, impl="triton"
        )


# ----------------------------------------------------------------------------------------------
# compiled on a real GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_realistic_compaction_matches_reference(device, dtype):
    """Llama-3.1-8B-like pool, default launch parameters, 64 rows compacted in place at page size 16
    (long overlapping chains: races between chunks or warps would show up as wrong bytes)."""
    g = torch.Generator().manual_seed(7)
    page, layers, heads, dim = 16, 32, 8, 128
    lens = torch.randint(200, 600, (64,), generator=g).tolist()
    rows = page_dense_rows(page, lens, num_pages=2600, g=g)
    keeps = [(torch.rand(n, generator=g) < 0.5).tolist() for n in lens]
    keeps[0] = [False] + [True] * (lens[0] - 1)
    src, dst = compaction_moves(rows, keeps, [0] * len(lens))
    keys = random_layers(layers, 2600 * page, heads, dim, dtype, g, device)
    values = random_layers(layers, 2600 * page, heads, dim, dtype, g, device)
    src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    k_exp, v_exp = run_both(keys, values, src_t, dst_t, check=True)
    torch.cuda.synchronize()
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")
