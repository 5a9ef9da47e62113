"""Triton per-slot attention scores for a decode step (the signal H2O / TOVA / Scissorhands need).

Attention backends never materialize probabilities. For each request b and kept slot s this
recomputes them from the decode query and the cached keys:

    p[b, h, s] = exp(sm_scale * q[b, h] . k[s, h // group] - lse[b, h])

with the attention's own log-sum-exp when it returned one (FlashInfer's `return_lse`, base 2 by
default) or one computed here, and folds them into a per-slot buffer, summed over the query heads
of each KV head (score [num_slots, Hkv]) or over all heads (score [num_slots]):

    decay == 1:  score[s] += sum_h p          (atomic: slots shared by several rows add up)
    decay != 1:  score[s]  = decay * score[s] + sum_h p     (each slot in at most one row)

Program (b, split) owns slot blocks split, split + num_splits, ... of row b and all heads, so one
key block is loaded once per KV head and the head sum stays in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_kernel(
    # Inputs
    q_ptr,  # [bs, HQ, D]
    stride_qb,
    stride_qh,
    k_ptr,  # [num_slots, HKV, D]
    stride_ks,
    stride_kh,
    kv_indptr_ptr,  # [bs + 1]
    kv_indices_ptr,  # [nnz] token slots
    sm_scale,
    # Outputs
    lse_ptr,  # [bs, HQ] fp32, natural log
    # Constants
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    end = tl.load(kv_indptr_ptr + b + 1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + hq * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    k_head = k_ptr + (hq // GROUP) * stride_kh + offs_d
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(kv_indices_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_head[None, :] + (slots * stride_ks)[:, None], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        logits = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * sm_scale
        logits = tl.where(mask_n, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=0))  # finite: the block has a valid lane
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new), axis=0)
        m = m_new
    nonempty = s > 0
    tl.store(lse_ptr + b * HQ + hq, tl.where(nonempty, m + tl.log(tl.where(nonempty, s, 1.0)), float("-inf")))


@triton.jit
def _attn_scores_kernel(
    # Inputs
    q_ptr,  # [bs, HKV * GROUP, D]
    stride_qb,
    stride_qh,
    k_ptr,  # [num_slots, HKV, D]
    stride_ks,
    stride_kh,
    kv_indptr_ptr,  # [bs + 1]
    kv_indices_ptr,  # [nnz] token slots
    lse_ptr,  # [bs, HKV * GROUP] float
    stride_lb,
    stride_lh,
    sm_scale,
    lse_scale,  # multiplies lse into natural-log units (ln 2 for base-2 LSE)
    decay,
    num_splits,
    # In/out
    score_ptr,  # [num_slots] or [num_slots, HKV] fp32
    stride_ss,
    stride_sh,
    # Constants
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PER_HEAD: tl.constexpr,  # score is [num_slots, HKV]
    MODE: tl.constexpr,  # 0: score += p (atomic), 1: score = decay*score + p, 2: score = p
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    start = tl.load(kv_indptr_ptr + b).to(tl.int64)
    end = tl.load(kv_indptr_ptr + b + 1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_row = q_ptr + b.to(tl.int64) * stride_qb + offs_d
    lse_row = lse_ptr + b.to(tl.int64) * stride_lb
    for n0 in range(start + split * BLOCK_N, end, num_splits * BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(kv_indices_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        total = tl.zeros([BLOCK_N], tl.float32)
        for hk in tl.static_range(HKV):
            k = tl.load(
                k_ptr + (slots * stride_ks)[:, None] + hk * stride_kh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            acc = tl.zeros([BLOCK_N], tl.float32)
            for g in tl.static_range(GROUP):
                hq = hk * GROUP + g
                q = tl.load(q_row + hq * stride_qh, mask=mask_d, other=0.0).to(tl.float32)
                lse = tl.load(lse_row + hq * stride_lh).to(tl.float32) * lse_scale
                logits = tl.sum(k * q[None, :], axis=1) * sm_scale
                acc += tl.exp(logits - lse)
            if PER_HEAD:
                _fold(score_ptr + slots * stride_ss + hk * stride_sh, acc, mask_n, decay, MODE)
            else:
                total += acc
        if not PER_HEAD:
            _fold(score_ptr + slots * stride_ss, total, mask_n, decay, MODE)


@triton.jit
def _fold(ptrs, p, mask, decay, MODE: tl.constexpr):
    if MODE == 0:
        tl.atomic_add(ptrs, p, mask=mask)
    elif MODE == 1:
        tl.store(ptrs, decay * tl.load(ptrs, mask=mask, other=0.0) + p, mask=mask)
    else:
        tl.store(ptrs, p, mask=mask)


def launch_attn_scores(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score: torch.Tensor,
    sm_scale: float,
    lse: torch.Tensor | None,
    lse_scale: float,
    decay: float,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> None:
    """Launch on validated arguments (see `sgl_vtoken.kernels.attn_scores_`)."""
    device = q.device
    interpreted = type(_attn_scores_kernel).__name__ == "InterpretedFunction"
    if device.type == "cpu" and not interpreted:
        raise ValueError(
            "impl='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "sgl_vtoken.kernels.attn_scores is first imported, or use impl='torch'"
        )
    bs, hq, head_dim = q.shape
    hkv = k_buffer.shape[1]
    if bs == 0:
        return
    kv_indptr, kv_indices = kv_indptr.contiguous(), kv_indices.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 16 if interpreted else max(16, min(64, 8192 // block_d))
    if lse is None:
        lse = torch.empty(bs, hq, dtype=torch.float32, device=device)
        _lse_kernel[(bs, hq)](
            q, q.stride(0), q.stride(1), k_buffer, k_buffer.stride(0), k_buffer.stride(1),
            kv_indptr, kv_indices, sm_scale, lse,
            HQ=hq, GROUP=hq // hkv, D=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        )  # fmt: skip
        lse_scale = 1.0
    if num_splits is None:
        if interpreted:
            num_splits = 2
        else:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = max(1, min(64, triton.cdiv(8 * sms, bs)))
    mode = 0 if decay == 1.0 else (2 if decay == 0.0 else 1)
    _attn_scores_kernel[(bs, num_splits)](
        q, q.stride(0), q.stride(1), k_buffer, k_buffer.stride(0), k_buffer.stride(1),
        kv_indptr, kv_indices, lse, lse.stride(0), lse.stride(1),
        sm_scale, lse_scale, decay, num_splits,
        score, score.stride(0), score.stride(1) if score.ndim == 2 else 0,
        HKV=hkv, GROUP=hq // hkv, D=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        PER_HEAD=score.ndim == 2, MODE=mode,
    )  # fmt: skip
