"""`attn_scores_`: decode attention probabilities folded into per-slot scores, in place.

Validates its arguments (attributes only, no device sync unless `check=True`), then runs the
Triton kernel of `attn_scores.py` (imported on first use) or the torch reference.
"""

from __future__ import annotations

import math

import torch

from . import _checks as C
from . import reference as ref

LSE_BASES = ("ln", "log2")


def attn_scores_(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score: torch.Tensor,
    sm_scale: float,
    *,
    lse: torch.Tensor | None = None,
    lse_base: str = "ln",
    decay: float = 1.0,
    by_entry: bool = False,
    impl: str | None = None,
    check: bool = False,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Fold this decode step's attention probabilities into a per-slot score buffer, in place.

    For request b, query head h and slot s = kv_indices[kv_indptr[b] + j]:
    p = exp(sm_scale * q[b, h] . k_buffer[s, h // (Hq/Hkv)] - lse[b, h]); then
    score[s] = decay * score[s] + sum of p over the heads (and over rows reading s when decay == 1).
    With `by_entry` the buffer is indexed like kv_indices instead: score[e] for e = kv_indptr[b] + j
    (one row per entry, so rows reading the same slot keep their own probabilities, and the
    buffer is sized by the batch's rows, not by the pool).

    Args:
        q: [bs, Hq, D] decode queries (float16/bfloat16/float32; last dim contiguous).
        k_buffer: [num_slots, Hkv, D] keys of one layer, same dtype family; Hq % Hkv == 0.
        kv_indptr: [bs+1] int32/int64 CSR offsets into kv_indices (token level, page size 1).
        kv_indices: [>= kv_indptr[-1]] int32/int64 slots (entries past kv_indptr[-1] are ignored).
        score: [num_slots] (sum over all heads) or [num_slots, Hkv] (per KV head) float32; with
            `by_entry`, [nnz] or [nnz, Hkv] where nnz = kv_indices.numel() (any strides).
        sm_scale: the attention's softmax scale (no logit soft-capping).
        lse: optional [bs, Hq] float32 log-sum-exp from the attention; computed when None.
        lse_base: "ln" (natural log) or "log2" (FlashInfer's default `return_lse` convention).
        decay: 1.0 accumulates (H2O); 0.0 overwrites with this step (TOVA); other values give an
            exponential moving sum. With decay != 1 every slot may appear in at most one row
            (slots shared through the radix tree: keep decay 1, or use `by_entry`); `check=True`
            verifies it.
        by_entry: index `score` by kv_indices entry rather than by slot.
        impl: "triton", "torch", or None (Triton on CUDA, torch otherwise).
        block_n, num_splits, num_warps, num_stages: Triton tuning knobs (tokens per tile,
            programs per request, warps per program, software-pipelining depth); None takes
            `attn_scores.default_launch`.

    The LSE should come from the attention that just ran: on GPU, FlashInfer's decode wrappers
    return it with `return_lse=True` (base 2, `lse_base="log2"`). Then the kernel reads K once.
    Without it the kernel computes the LSE in a first pass over K (twice the memory traffic):
    a fallback, exact but slower. Never synchronizes with the device unless `check=True`.
    """
    for name, t in (("q", q), ("k_buffer", k_buffer), ("score", score)):
        C.check_tensor(t, name)
    C.check_ndim(q, "q", 3, "[bs, Hq, D]")
    C.check_ndim(k_buffer, "k_buffer", 3, "[num_slots, Hkv, D]")
    C.check_dtype(q, "q", C.FLOAT_DTYPES)
    C.check_dtype(k_buffer, "k_buffer", C.FLOAT_DTYPES)
    C.check_inner_contiguous(q, "q")
    C.check_inner_contiguous(k_buffer, "k_buffer")
    device = q.device
    C.check_device(k_buffer, "k_buffer", device, "q")
    bs, hq, head_dim = q.shape
    num_slots, hkv, k_dim = k_buffer.shape
    if k_dim != head_dim:
        raise ValueError(f"k_buffer has head_dim {k_dim} but q has {head_dim}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of k_buffer's {hkv} KV heads")
    C.check_index_vector(kv_indptr, "kv_indptr", device, "q", numel=bs + 1)
    C.check_index_vector(kv_indices, "kv_indices", device, "q")
    C.check_dtype(score, "score", (torch.float32,))
    C.check_device(score, "score", device, "q")
    rows, what = (kv_indices.numel(), "nnz") if by_entry else (num_slots, "num_slots")
    if score.shape not in ((rows,), (rows, hkv)):
        raise ValueError(
            f"score must be [{what}]={rows} or [{what}, Hkv]=[{rows}, {hkv}], "
            f"got {tuple(score.shape)}"
        )
    C.check_no_self_overlap(score, "score")
    if lse is not None:
        C.check_tensor(lse, "lse")
        C.check_dtype(lse, "lse", (torch.float32,))
        C.check_device(lse, "lse", device, "q")
        if tuple(lse.shape) != (bs, hq):
            raise ValueError(f"lse must be [bs, Hq]=[{bs}, {hq}], got {tuple(lse.shape)}")
    if lse_base not in LSE_BASES:
        raise ValueError(f"lse_base must be one of {LSE_BASES}, got {lse_base!r}")
    if not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite float, got {sm_scale!r}")
    if not isinstance(decay, (int, float)) or not math.isfinite(decay):
        raise ValueError(f"decay must be a finite float, got {decay!r}")
    impl = C.resolve_impl(impl, device)
    if check:
        _check_score_rows(kv_indptr, kv_indices, num_slots, decay if not by_entry else 1.0)
    if impl == "torch":
        ref.attn_scores_ref_(
            q,
            k_buffer,
            kv_indptr,
            kv_indices,
            score,
            float(sm_scale),
            lse,
            lse_base,
            float(decay),
            by_entry=by_entry,
        )
        return
    C.triton_module("attn_scores").launch_attn_scores(
        q, k_buffer, kv_indptr, kv_indices, score, float(sm_scale), lse, lse_base, float(decay),
        by_entry=by_entry, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip


def _check_score_rows(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_slots: int, decay: float
) -> None:
    ptr = kv_indptr.long()
    if bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[0]) < 0 or int(ptr[-1]) > kv_indices.numel():
        raise ValueError(
            f"kv_indptr must be non-decreasing within [0, {kv_indices.numel()}], "
            f"got {ptr.tolist()[:8]}..."
        )
    slots = kv_indices[int(ptr[0]) : int(ptr[-1])].long()
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"kv_indices holds slots in [{lo}, {hi}], outside [0, {num_slots})")
        if decay != 1.0 and torch.unique(slots).numel() != slots.numel():
            raise ValueError(
                "with decay != 1 each slot may be read by one row only, "
                "but kv_indices repeats a slot"
            )
