"""Pure-torch oracles of what the server does around the kernels; fp32, no speed goals.

    apply_plan_ref               apply a RepackPlan to fake KV buffers, a row and an allocator
    attention_ref                attention over explicit K/V with an optional keep mask
    row_attention_ref            attention over the slots of one row (token-level pool)
    paged_decode_attention_ref   decode attention through FlashInfer's paged CSR triple

The kernels' own oracles (KV move, page indices, attention scores) sit beside the kernels in
`sgl_vtoken.kernels.reference`, one per operation; this module uses them rather than repeating
them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helpers.step_ref import RepackPlan
from sgl_vtoken.kernels.reference import repack_kv_ref_
from sgl_vtoken.pages import PageAllocator


def apply_plan_ref(
    plan: RepackPlan,
    buffers: Sequence[torch.Tensor],
    row: torch.Tensor,
    allocator: PageAllocator | None = None,
) -> int:
    """Apply `plan` to slot-indexed `buffers` (every layer's K and V), the request's 1-D
    `row` of ``req_to_token`` (rewritten in place) and `allocator`; returns the new length."""
    repack_kv_ref_(list(buffers), [], plan.src, plan.dst)  # the KV move, gather then scatter
    if plan.row_slots.numel():
        row[plan.row_start : plan.new_len] = plan.row_slots.to(row.dtype)
    if allocator is not None and plan.num_freed_pages:
        allocator.free(plan.freed_pages)
    return plan.new_len


def _expand_gqa(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[n, Hkv, D] -> [n, Hq, D]``: query head h reads KV head ``h // (Hq // Hkv)``."""
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention of one query ``q [Hq, D]`` over ``k, v [n, Hkv, D]`` in fp32.

    `keep` ``[n] bool`` masks evicted keys (False = masked). Returns ``[Hq, D]`` float32.
    """
    hq, d = q.shape
    scale = d**-0.5 if scale is None else scale
    kk, vv = _expand_gqa(k.float(), hq), _expand_gqa(v.float(), hq)  # [n, Hq, D]
    logits = torch.einsum("hd,nhd->hn", q.float(), kk) * scale  # [Hq, n]
    if keep is not None:
        logits = logits.masked_fill(~keep.unsqueeze(0), float("-inf"))
    return torch.einsum("hn,nhd->hd", logits.softmax(dim=-1), vv)


def row_attention_ref(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over the tokens at `slots` of a token-level pool ``k_buf [num_slots, Hkv, D]``."""
    return attention_ref(q, k_buf[slots], v_buf[slots], scale=scale)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Batched decode attention through FlashInfer's CSR triple.

    Args:
        q: ``[B, Hq, D]``; k_pages, v_pages: ``[num_pages, ps, Hkv, D]`` (NHD paged cache).
        kv_indptr ``[B+1]``, kv_indices, kv_last_page_len ``[B]``: as from
            ``sgl_vtoken.kernels.page_indices`` (oracle: ``page_indices_ref``).
    Returns: ``[B, Hq, D]`` float32.
    """
    ps = k_pages.shape[1]
    out = []
    for b in range(q.shape[0]):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        n = max(pages.numel() - 1, 0) * ps + int(kv_last_page_len[b])
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n]
        out.append(attention_ref(q[b], k, v, scale=scale))
    return torch.stack(out) if out else q.new_zeros(q.shape, dtype=torch.float32)
