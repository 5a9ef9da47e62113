"""Triton decode attention scores: this step's probabilities folded into a score buffer.

Contract (arguments validated by `attn_scores_api.attn_scores_`): for row b, query head h and
slot s, p = exp2(sm_scale * log2(e) * q[b, h] . k[s, h // group] - lse2[b, h]), summed over each
KV head's group (score [num_slots, Hkv]) or all heads ([num_slots]); MODE 0 adds atomically
(decay 1: shared slots add up), 1 stores decay * score + p, 2 overwrites; BY_ENTRY indexes score
like kv_indices (one row per entry). Built to stream K: program (b, split) owns a token range
of row b and every head; a tile is BLOCK_N tokens x all KV heads (one read per token), logits by
one tensor-core `tl.dot` against all query heads, masked to each row's group. Without an LSE,
PASS 0 writes per-split (max, sum) partials that PASS 1 merges (two reads of K: the fallback).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import _checks as C

LOG2E = 1.0 / math.log(2.0)
_TILE_BYTES = 32768  # bytes of K per tile on a GPU
_MAX_LOGITS = 8192  # BLOCK_R x HQ_PAD fp32 logits per tile


# Kernel parameters stay unannotated: Triton reads their annotations (tl.constexpr).
@triton.jit
def _qk_tile(  # type: ignore[no-untyped-def]
    k_ptr, stride_ks, stride_kh, kv_indices_ptr, q_t, n0, hi,
    HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Logits [BLOCK_R, HQ_PAD] of tokens n0 .. n0 + BLOCK_N (< hi) x all KV heads, the rows'
    slots [BLOCK_R] int64, KV heads [BLOCK_R] and validity [BLOCK_R]."""
    r = tl.arange(0, BLOCK_N * HKV_PAD)
    n = n0 + r // HKV_PAD
    hk = r % HKV_PAD
    valid = (n < hi) & (hk < HKV)
    slot = tl.load(kv_indices_ptr + n, mask=n < hi, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    rows = k_ptr + (slot * stride_ks + hk * stride_kh)[:, None] + offs_d[None, :]
    if BLOCK_D == D:
        k = tl.load(rows, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(rows, mask=valid[:, None] & (offs_d < D)[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    # every query head, not just the row's group: the HKV_PAD x waste is cheap next to the K read
    return tl.dot(k, q_t, input_precision=PRECISION), slot, hk, valid


@triton.jit
def _attn_scores_kernel(  # type: ignore[no-untyped-def]
    # Inputs
    q_ptr,  # [bs, HQ, D]
    stride_qb,
    stride_qh,
    k_ptr,  # [num_slots, HKV, D]
    stride_ks,
    stride_kh,
    kv_indptr_ptr,  # [bs + 1]
    kv_indices_ptr,  # [nnz] token slots
    lse_ptr,  # [bs, HQ] float (LSE_GIVEN)
    stride_lb,
    stride_lh,
    qk_scale,  # sm_scale * log2(e)
    lse_scale,  # multiplies lse into base-2 units
    decay,
    num_splits,
    # Partials (PASS 0 writes, PASS 1 reads unless LSE_GIVEN)
    part_ptr,  # [bs, num_splits, 2, HQ_PAD] fp32: running max and sum, base 2
    # In/out
    score_ptr,  # [num_slots] or [num_slots, HKV] fp32
    stride_ss,
    stride_sh,
    # Constants
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PASS: tl.constexpr,  # 0: LSE partials, 1: scores
    LSE_GIVEN: tl.constexpr,
    PER_HEAD: tl.constexpr,  # score is [num_slots, HKV] ([nnz, HKV] BY_ENTRY)
    BY_ENTRY: tl.constexpr,  # score is indexed by kv_indices entry, not by slot
    MODE: tl.constexpr,  # 0: score += p (atomic), 1: score = decay*score + p, 2: score = p
    UPCAST: tl.constexpr,  # fp32 dot (interpreter, fp32 or mixed inputs)
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    end = tl.load(kv_indptr_ptr + b + 1).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, end)

    hq = tl.arange(0, HQ_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    q_t = tl.load(  # [BLOCK_D, HQ_PAD]: Q^T of row b, zero past HQ and D
        q_ptr + b.to(tl.int64) * stride_qb + hq[None, :] * stride_qh + offs_d[:, None],
        mask=(hq[None, :] < HQ) & (offs_d[:, None] < D),
        other=0.0,
    )
    if UPCAST:
        q_t = q_t.to(tl.float32)
    r_head = tl.arange(0, BLOCK_N * HKV_PAD) % HKV_PAD
    own = (hq[None, :] // GROUP) == r_head[:, None]  # [BLOCK_R, HQ_PAD]: the row's group
    part_row = part_ptr + (b.to(tl.int64) * num_splits) * (2 * HQ_PAD)

    if PASS == 0:
        m = tl.full([HQ_PAD], float("-inf"), tl.float32)
        s = tl.zeros([HQ_PAD], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            logits, slot, hk, valid = _qk_tile(
                k_ptr, stride_ks, stride_kh, kv_indices_ptr, q_t, n0, hi,
                HKV, HKV_PAD, D, BLOCK_D, BLOCK_N, UPCAST, PRECISION,
            )  # fmt: skip
            x = tl.where(own & valid[:, None], logits * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            s = s * tl.exp2(m - m_ref) + tl.sum(tl.exp2(x - m_ref[None, :]), axis=0)
            m = m_new
        tl.store(part_row + split * (2 * HQ_PAD) + hq, m)
        tl.store(part_row + split * (2 * HQ_PAD) + HQ_PAD + hq, s)
    else:
        if LSE_GIVEN:
            lse = tl.load(
                lse_ptr + b.to(tl.int64) * stride_lb + hq * stride_lh, mask=hq < HQ, other=0.0
            )
            lse2 = lse.to(tl.float32) * lse_scale
        else:  # merge the row's partials: lse2 = M + log2(sum_i s_i * 2^(m_i - M))
            mx = tl.full([HQ_PAD], float("-inf"), tl.float32)
            for i in range(0, num_splits):
                mx = tl.maximum(mx, tl.load(part_row + i * (2 * HQ_PAD) + hq))
            mx = tl.where(mx == float("-inf"), 0.0, mx)
            total = tl.zeros([HQ_PAD], tl.float32)
            for i in range(0, num_splits):
                mi = tl.load(part_row + i * (2 * HQ_PAD) + hq)
                total += tl.load(part_row + i * (2 * HQ_PAD) + HQ_PAD + hq) * tl.exp2(mi - mx)
            lse2 = mx + tl.log2(tl.where(total > 0, total, 1.0))  # 0: padding head or empty row
        for n0 in range(lo, hi, BLOCK_N):
            logits, slot, hk, valid = _qk_tile(
                k_ptr, stride_ks, stride_kh, kv_indices_ptr, q_t, n0, hi,
                HKV, HKV_PAD, D, BLOCK_D, BLOCK_N, UPCAST, PRECISION,
            )  # fmt: skip
            p = tl.where(own & valid[:, None], tl.exp2(logits * qk_scale - lse2[None, :]), 0.0)
            p_row = tl.sum(p, axis=1)  # [BLOCK_R]: one (token, KV head), summed over its group
            if PER_HEAD:
                if BY_ENTRY:
                    slot = n0 + tl.arange(0, BLOCK_N * HKV_PAD) // HKV_PAD  # the rows' entries
                _fold(score_ptr + slot * stride_ss + hk * stride_sh, p_row, valid, decay, MODE)
            else:
                p_tok = tl.sum(tl.reshape(p_row, [BLOCK_N, HKV_PAD]), axis=1)  # [BLOCK_N]
                offs_n = n0 + tl.arange(0, BLOCK_N)
                if BY_ENTRY:
                    slots = offs_n
                else:
                    slots = tl.load(kv_indices_ptr + offs_n, mask=offs_n < hi, other=0).to(tl.int64)
                _fold(score_ptr + slots * stride_ss, p_tok, offs_n < hi, decay, MODE)


@triton.jit
def _fold(ptrs, p, mask, decay, MODE: tl.constexpr):  # type: ignore[no-untyped-def]
    if MODE == 0:
        tl.atomic_add(ptrs, p, mask=mask)
    elif MODE == 1:
        tl.store(ptrs, decay * tl.load(ptrs, mask=mask, other=0.0) + p, mask=mask)
    else:
        tl.store(ptrs, p, mask=mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_launch(
    bs: int,
    hq: int,
    hkv: int,
    head_dim: int,
    elem: int,
    tokens: int,
    *,
    num_sms: int | None,
    lse_given: bool = True,
) -> tuple[int, int, int]:
    """(block_n, num_splits, num_warps); num_sms None means the interpreter.

    A tile is block_n tokens x every KV head, about 32 KiB of K (fewer rows when there are
    many query heads, to bound the fp32 logits). Rows are split so that about 4 programs per SM
    run (each keeps one or two tiles in flight), each with at least two tiles of the average row
    (`tokens` = kv_indices entries / bs, an upper bound known without a device sync); at most 256
    splits (64 when the LSE is computed: every program merges its row's partials).
    """
    hkv_pad, hq_pad = triton.next_power_of_2(hkv), max(16, triton.next_power_of_2(hq))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_sms is None:  # interpreter: few fat tiles
        return max(1, 64 // hkv_pad), 2, 4
    rows = min(_TILE_BYTES // (block_d * elem), _MAX_LOGITS // hq_pad)
    block_n = triton.next_power_of_2(max(1, rows // hkv_pad))
    block_n = max(block_n, triton.cdiv(16, hkv_pad))  # tl.dot needs >= 16 rows
    splits = max(
        1,
        min(
            256 if lse_given else 64, triton.cdiv(4 * num_sms, max(bs, 1)), tokens // (2 * block_n)
        ),
    )
    return block_n, splits, 4


def launch_attn_scores(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score: torch.Tensor,
    sm_scale: float,
    lse: torch.Tensor | None,
    lse_base: str,
    decay: float,
    *,
    by_entry: bool = False,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Launch on arguments `sgl_vtoken.kernels.attn_scores_` validated (its docstring gives the
    shapes, dtypes and tuning knobs); no host sync."""
    device = q.device
    interpreted = C.interpreted(_attn_scores_kernel, device, "attn_scores")
    bs, hq, head_dim = q.shape
    hkv = k_buffer.shape[1]
    if bs == 0:
        return
    kv_indptr, kv_indices = kv_indptr.contiguous(), kv_indices.contiguous()
    bn, splits, nw = default_launch(
        bs, hq, hkv, head_dim, k_buffer.element_size(), kv_indices.numel() // bs,
        num_sms=None if interpreted else _num_sms(device), lse_given=lse is not None,
    )  # fmt: skip
    block_n, num_splits, num_warps = block_n or bn, num_splits or splits, num_warps or nw
    upcast = interpreted or q.dtype != k_buffer.dtype or k_buffer.dtype == torch.float32
    hq_pad = max(16, triton.next_power_of_2(hq))
    hkv_pad = triton.next_power_of_2(hkv)
    block_n = max(block_n, triton.cdiv(16, hkv_pad))
    part = (
        score
        if lse is not None
        else torch.empty(bs * num_splits * 2 * hq_pad, dtype=torch.float32, device=device)
    )
    mode = 2 if decay == 0.0 else (1 if decay != 1.0 or by_entry else 0)  # entries: one row each
    meta = dict(
        HQ=hq, HKV=hkv, GROUP=hq // hkv, HQ_PAD=hq_pad, HKV_PAD=hkv_pad, D=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=block_n,
        LSE_GIVEN=lse is not None, PER_HEAD=score.ndim == 2, BY_ENTRY=by_entry, MODE=mode,
        UPCAST=upcast, PRECISION="ieee" if upcast else "tf32", num_warps=num_warps,
    )  # fmt: skip
    if num_stages is not None:
        meta["num_stages"] = num_stages
    lse_t = lse if lse is not None else part
    args = (
        q, q.stride(0), q.stride(1), k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        kv_indptr, kv_indices, lse_t, lse_t.stride(0), lse_t.stride(-1),
        sm_scale * LOG2E, LOG2E if lse_base == "ln" else 1.0, decay, num_splits,
        part, score, score.stride(0), score.stride(1) if score.ndim == 2 else 0,
    )  # fmt: skip
    if lse is None:
        _attn_scores_kernel[(bs, num_splits)](*args, PASS=0, **meta)
    _attn_scores_kernel[(bs, num_splits)](*args, PASS=1, **meta)
