"""attn_scores_: per-slot decode attention probabilities, Triton against the torch reference."""

import math

import pytest
import torch

from sgl_vtoken.kernels import attn_lse_ref, attn_scores_, attn_scores_ref_
from sgl_vtoken.kernels.attn_scores import default_launch

TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 maths; summation order and exp differ between impls


def _batch(bs_lens, hq, hkv, dim, num_slots, g, device, dtype=torch.float32, idx_dtype=torch.int32):
    """Decode batch with rows on disjoint random slots; returns q, k, kv_indptr, kv_indices."""
    q = torch.randn(len(bs_lens), hq, dim, generator=g).to(dtype).to(device)
    k = torch.randn(num_slots, hkv, dim, generator=g).to(dtype).to(device)
    indptr = torch.tensor(
        [0] + torch.tensor(bs_lens).cumsum(0).tolist(), dtype=idx_dtype, device=device
    )
    idx = torch.randperm(num_slots, generator=g)[: sum(bs_lens)].to(idx_dtype).to(device)
    return q, k, indptr, idx


def _lse(mode, q, k, indptr, idx, sm_scale):
    if mode is None:
        return None
    lse = attn_lse_ref(q, k, indptr, idx, sm_scale)
    return lse / math.log(2.0) if mode == "log2" else lse


@pytest.mark.parametrize("hq,hkv,dim", [(4, 2, 32), (6, 3, 80), (3, 1, 96), (2, 2, 16)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lse_mode", [None, "ln", "log2"])
@pytest.mark.parametrize("decay", [1.0, 0.0, 0.5])
def test_matches_reference(device, hq, hkv, dim, per_head, lse_mode, decay):
    g = torch.Generator().manual_seed(hq * 100 + dim)
    idx_dtype = torch.int64 if per_head else torch.int32
    q, k, indptr, idx = _batch([9, 0, 37, 1], hq, hkv, dim, 64, g, device, idx_dtype=idx_dtype)
    sm_scale = 1.0 / math.sqrt(dim)
    lse = _lse(lse_mode, q, k, indptr, idx, sm_scale)
    score0 = torch.rand((64, hkv) if per_head else (64,), generator=g).to(device)
    expected, got = score0.clone(), score0.clone()
    kw = dict(lse=lse, lse_base=lse_mode or "ln", decay=decay, check=True)
    attn_scores_(q, k, indptr, idx, expected, sm_scale, impl="torch", **kw)
    attn_scores_(q, k, indptr, idx, got, sm_scale, impl="triton", **kw)
    torch.testing.assert_close(got, expected, **TOL)
    untouched = torch.ones(64, dtype=torch.bool, device=device)
    untouched[idx[: int(indptr[-1])].long()] = False
    assert torch.equal(got[untouched], score0[untouched])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(device, dtype):
    g = torch.Generator().manual_seed(1)
    q, k, indptr, idx = _batch([5, 30], 8, 2, 64, 48, g, device, dtype=dtype)
    expected, got = torch.zeros(48, device=device), torch.zeros(48, device=device)
    attn_scores_(q, k, indptr, idx, expected, 0.125, impl="torch")
    attn_scores_(q, k, indptr, idx, got, 0.125, impl="triton")
    torch.testing.assert_close(got, expected, **TOL)  # inputs upcast exactly, maths in fp32


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_probabilities_match_an_explicit_softmax(device, impl):
    """Independent oracle: softmax over a row's logits; summed per slot over the heads."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, dim = 4, 2, 24
    q, k, indptr, idx = _batch([11, 6], hq, hkv, dim, 32, g, device)
    score = torch.zeros(32, hkv, device=device)
    attn_scores_(q, k, indptr, idx, score, 0.3, impl=impl)
    for b in range(2):
        slots = idx[int(indptr[b]) : int(indptr[b + 1])].long()
        for h in range(hq):
            logits = 0.3 * (k[slots, h // 2].cpu() @ q[b, h].cpu())
            probs = torch.softmax(logits.double(), 0)
            score_row = score[slots, h // 2].cpu().double()
            # the KV head's score is the sum over its two query heads
            if h % 2 == 0:
                other = torch.softmax(
                    0.3 * (k[slots, h // 2].cpu() @ q[b, h + 1].cpu()).double(), 0
                )
                torch.testing.assert_close(score_row, probs + other, rtol=1e-5, atol=1e-6)
        # every query head spreads exactly one unit of probability over the row
        assert abs(float(score[slots].sum()) - hq) < 1e-4


def test_shared_slots_add_up_with_decay_one(device):
    """Two rows reading the same prefix slots (radix sharing) both contribute."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 16, generator=g).to(device)
    k = torch.randn(20, 1, 16, generator=g).to(device)
    idx = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 9], device=device)  # slots 0-3 shared
    indptr = torch.tensor([0, 5, 10], device=device)
    expected, got = torch.zeros(20, device=device), torch.zeros(20, device=device)
    attn_scores_(q, k, indptr, idx, expected, 0.25, impl="torch", check=True)
    attn_scores_(q, k, indptr, idx, got, 0.25, impl="triton", check=True)
    torch.testing.assert_close(got, expected, **TOL)
    assert abs(float(got.sum()) - 4.0) < 1e-5  # 2 rows x 2 heads, one unit each
    with pytest.raises(ValueError, match="with decay != 1 each slot may be read by one row only"):
        attn_scores_(q, k, indptr, idx, got, 0.25, decay=0.5, check=True)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lse_mode", [None, "log2"])
@pytest.mark.parametrize("decay", [1.0, 0.0, 0.5])
def test_by_entry_matches_reference_and_keeps_shared_slots_apart(device, per_head, lse_mode, decay):
    """by_entry: a buffer indexed like kv_indices. Rows 0 and 2 read the same prefix slots (radix
    sharing); each entry gets only its own row's probability, whatever the decay."""
    g = torch.Generator().manual_seed(11)
    hq, hkv, dim = 6, 2, 32
    q = torch.randn(3, hq, dim, generator=g).to(device)
    k = torch.randn(40, hkv, dim, generator=g).to(device)
    shared = torch.randperm(40, generator=g)[:12]
    rows = [
        torch.cat([shared[:8], shared[8:9]]),
        torch.empty(0, dtype=torch.int64),
        torch.cat([shared[:8], shared[9:]]),
    ]
    idx = torch.cat(rows).to(device)
    indptr = torch.tensor([0, 9, 9, 20], device=device)
    sm_scale = 0.2
    lse = _lse(lse_mode, q, k, indptr, idx, sm_scale)
    score0 = torch.rand((20, hkv) if per_head else (20,), generator=g).to(device)
    expected, got = score0.clone(), score0.clone()
    kw = dict(lse=lse, lse_base=lse_mode or "ln", decay=decay, by_entry=True, check=True)
    attn_scores_(q, k, indptr, idx, expected, sm_scale, impl="torch", **kw)
    attn_scores_(q, k, indptr, idx, got, sm_scale, impl="triton", num_splits=2, block_n=4, **kw)
    torch.testing.assert_close(got, expected, **TOL)
    for b in (0, 2):  # independent oracle: the row alone, slot-indexed, read back at its slots
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        alone = torch.zeros((40, hkv) if per_head else (40,), device=device)
        attn_scores_(
            q[b : b + 1],
            k,
            torch.tensor([0, hi - lo], device=device),
            idx[lo:hi],
            alone,
            sm_scale,
            impl="torch",
        )
        torch.testing.assert_close(
            got[lo:hi], decay * score0[lo:hi] + alone[idx[lo:hi].long()], **TOL
        )


def test_by_entry_writes_a_strided_view(device):
    """The server writes each layer's scores into column `layer` of a [nnz, layers, Hkv] buffer."""
    g = torch.Generator().manual_seed(12)
    q, k, indptr, idx = _batch([7, 20], 4, 2, 16, 48, g, device)
    buf = torch.zeros(27, 3, 2, device=device)
    expected = torch.zeros(27, 2, device=device)
    attn_scores_(q, k, indptr, idx, expected, 0.3, decay=0.0, by_entry=True, impl="torch")
    attn_scores_(q, k, indptr, idx, buf[:, 1], 0.3, decay=0.0, by_entry=True, impl="triton")
    torch.testing.assert_close(buf[:, 1], expected, **TOL)
    assert not buf[:, 0].any() and not buf[:, 2].any()


def test_entries_past_the_batch_are_ignored(device):
    """Graph-mode index buffers are larger than the batch and hold stale slot ids past kv_indptr[-1]."""
    g = torch.Generator().manual_seed(4)
    q, k, indptr, idx = _batch([4, 3], 2, 1, 8, 16, g, device)
    padded = torch.cat([idx, torch.full((9,), 10**6, dtype=idx.dtype, device=device)])
    expected, got = torch.zeros(16, device=device), torch.zeros(16, device=device)
    attn_scores_(q, k, indptr, idx, expected, 0.5, impl="torch")
    attn_scores_(q, k, indptr, padded, got, 0.5, impl="triton", check=True)
    torch.testing.assert_close(got, expected, **TOL)


def test_empty_rows_and_empty_batch(device):
    g = torch.Generator().manual_seed(5)
    q, k, indptr, idx = _batch([0, 0], 2, 1, 8, 8, g, device)
    score = torch.ones(8, device=device)
    attn_scores_(q, k, indptr, idx, score, 0.5, impl="triton", check=True)
    assert bool((score == 1).all())
    attn_scores_(q[:0], k, indptr[:1], idx, score, 0.5, impl="triton")
    assert bool((score == 1).all())


def test_lse_is_computed_when_not_given(device):
    """Without lse the kernel computes it; the result equals passing the exact lse."""
    g = torch.Generator().manual_seed(6)
    q, k, indptr, idx = _batch([13, 40, 2], 4, 4, 48, 64, g, device)
    with_lse, without = torch.zeros(64, device=device), torch.zeros(64, device=device)
    attn_scores_(
        q, k, indptr, idx, with_lse, 0.2, lse=attn_lse_ref(q, k, indptr, idx, 0.2), impl="triton"
    )
    attn_scores_(q, k, indptr, idx, without, 0.2, impl="triton")
    torch.testing.assert_close(without, with_lse, **TOL)


@pytest.mark.parametrize(
    "hq,hkv,num_splits,block_n,lse_mode,per_head,decay",
    [
        (
            16,
            2,
            1,
            None,
            None,
            True,
            1.0,
        ),  # groups of 8, one split: every tile of a row in one program
        (8, 1, 3, 16, "log2", False, 0.0),  # MQA, splits of uneven fill
        (24, 3, 7, 8, None, True, 0.5),  # 24 query heads (padded to 32), 3 KV heads (padded to 4)
        (4, 4, 5, 4, "ln", False, 1.0),  # no grouping, more splits than tiles in short rows
        (12, 4, 2, 32, None, False, 0.0),  # one tile covers a whole split
    ],
)
def test_tiles_and_splits_match_reference(
    device, hq, hkv, num_splits, block_n, lse_mode, per_head, decay
):
    """Rows longer than a tile, split into uneven (and empty) ranges, slots in random order."""
    g = torch.Generator().manual_seed(hq * 10 + num_splits)
    lens = [70, 3, 0, 129, 16]
    q, k, indptr, idx = _batch(lens, hq, hkv, 32, 300, g, device)
    sm_scale = 0.3
    lse = _lse(lse_mode, q, k, indptr, idx, sm_scale)
    score0 = torch.rand((300, hkv) if per_head else (300,), generator=g).to(device)
    expected, got = score0.clone(), score0.clone()
    kw = dict(lse=lse, lse_base=lse_mode or "ln", decay=decay)
    attn_scores_ref_(q, k, indptr, idx, expected, sm_scale, **kw)
    attn_scores_(
        q,
        k,
        indptr,
        idx,
        got,
        sm_scale,
        impl="triton",
        num_splits=num_splits,
        block_n=block_n,
        **kw,
    )
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize(
    "shape,expected",
    [
        # Llama-3.1-8B on an H200: 16 tokens x 8 KV heads x 256 B = 32 KiB tiles
        (dict(bs=64, hq=32, hkv=8, head_dim=128, elem=2, tokens=2048), (16, 9, 4)),
        (dict(bs=8, hq=32, hkv=8, head_dim=128, elem=2, tokens=2048), (16, 64, 4)),
        (dict(bs=256, hq=32, hkv=8, head_dim=128, elem=2, tokens=4096), (16, 3, 4)),
        (dict(bs=1, hq=32, hkv=8, head_dim=128, elem=2, tokens=32768), (16, 256, 4)),
        (
            dict(bs=4, hq=9, hkv=3, head_dim=64, elem=2, tokens=100),
            (64, 1, 4),
        ),  # SmolLM2: short rows
        (
            dict(bs=2, hq=128, hkv=1, head_dim=128, elem=2, tokens=4096),
            (64, 32, 4),
        ),  # MQA: logits bound
    ],
)
def test_default_launch_parameters(shape, expected):
    assert default_launch(**shape, num_sms=132) == expected


def test_offsets_beyond_2_pow_31(device):
    """slot * slot_stride > 2**31 elements in k_buffer (a lazily committed ~4.3 GB reservation)."""
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 16 << 30:
        pytest.skip("needs ~5 GB of device memory")
    dim = 16
    num_slots = (1 << 31) // dim + 64
    k = torch.empty((num_slots, 1, dim), dtype=torch.float16, device=device)
    slots = torch.tensor([3, num_slots - 2, num_slots - 1], dtype=torch.int32, device=device)
    k[slots.long()] = torch.randn(3, 1, dim).half().to(device)
    q = torch.randn(1, 2, dim).to(device)
    indptr = torch.tensor([0, 3], dtype=torch.int32, device=device)
    expected = attn_lse_ref(q, k, indptr, slots, 0.25)
    p = torch.exp(0.25 * (k[slots.long(), 0].float() @ q[0].T) - expected[0]).sum(1)
    score = torch.empty(num_slots, device=device)  # only the 3 read slots are touched
    score[slots.long()] = 0.0
    attn_scores_(q, k, indptr, slots, score, 0.25, impl="triton")
    torch.testing.assert_close(score[slots.long()], p, **TOL)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.zeros(2, 4, 8, dtype=torch.float64)), "q has dtype torch.float64"),
        (dict(q=torch.zeros(2, 4)), "q must be 3-D"),
        (
            dict(k_buffer=torch.zeros(16, 3, 8)),
            "q has 4 heads, not a multiple of k_buffer's 3 KV heads",
        ),
        (dict(k_buffer=torch.zeros(16, 2, 12)), "k_buffer has head_dim 12 but q has 8"),
        (dict(kv_indptr=torch.tensor([0, 2])), "kv_indptr has 2 entries, expected 3"),
        (dict(kv_indices=torch.zeros(4)), "kv_indices has dtype torch.float32"),
        (dict(score=torch.zeros(16, dtype=torch.float64)), "score has dtype torch.float64"),
        (
            dict(score=torch.zeros(15)),
            r"score must be \[num_slots\]=16 or \[num_slots, Hkv\]=\[16, 2\]",
        ),
        (
            dict(score=torch.zeros(16), by_entry=True),
            r"score must be \[nnz\]=4 or \[nnz, Hkv\]=\[4, 2\]",
        ),
        (dict(lse=torch.zeros(2, 2)), r"lse must be \[bs, Hq\]=\[2, 4\]"),
        (dict(lse_base="e"), "lse_base must be one of"),
        (dict(decay=float("nan")), "decay must be a finite float"),
        (
            dict(kv_indices=torch.tensor([0, 1, 2, 16])),
            r"kv_indices holds slots in \[0, 16\], outside \[0, 16\)",
        ),
        (dict(kv_indptr=torch.tensor([0, 3, 2])), "kv_indptr must be non-decreasing"),
        (dict(impl="cuda"), "impl must be one of"),
    ],
)
def test_invalid_arguments(change, match):
    args = dict(
        q=torch.zeros(2, 4, 8),
        k_buffer=torch.zeros(16, 2, 8),
        kv_indptr=torch.tensor([0, 2, 4]),
        kv_indices=torch.tensor([0, 1, 2, 3]),
        score=torch.zeros(16),
        sm_scale=0.5,
        check=True,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        attn_scores_(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "per_head,lse_given,decay",
    [(False, True, 1.0), (True, True, 0.0), (True, False, 1.0), (False, False, 0.5)],
)
def test_gpu_realistic_decode_batch(device, per_head, lse_given, decay):
    """Llama-3.1-8B heads (32 query / 8 KV, head_dim 128, bf16: tensor-core logits), 64 rows of
    random lengths on random slots, default launch parameters."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 3000, (64,), generator=g).tolist()
    q, k, indptr, idx = _batch(lens, 32, 8, 128, 200_000, g, device, dtype=torch.bfloat16)
    lse = attn_lse_ref(q, k, indptr, idx, 1 / math.sqrt(128)) / math.log(2.0) if lse_given else None
    shape = (200_000, 8) if per_head else (200_000,)
    score0 = torch.rand(shape, generator=g).to(device)
    expected, got = score0.clone(), score0.clone()
    for t, impl in ((expected, "torch"), (got, "triton")):
        attn_scores_(
            q,
            k,
            indptr,
            idx,
            t,
            1 / math.sqrt(128),
            lse=lse,
            lse_base="log2",
            decay=decay,
            impl=impl,
        )
    torch.cuda.synchronize()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_default_path_never_syncs(device):
    """With or without an LSE, a call only enqueues work (the eviction step allows one sync)."""
    g = torch.Generator().manual_seed(8)
    q, k, indptr, idx = _batch([300, 17, 1000], 32, 8, 128, 4096, g, device, dtype=torch.bfloat16)
    lse = torch.zeros(3, 32, device=device)
    score = torch.zeros(4096, 8, device=device)
    for lse_arg in (lse, None):  # compile first
        attn_scores_(q, k, indptr, idx, score, 0.088, lse=lse_arg, lse_base="log2", decay=0.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for lse_arg in (lse, None):
            attn_scores_(q, k, indptr, idx, score, 0.088, lse=lse_arg, lse_base="log2", decay=0.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
