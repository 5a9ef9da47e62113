"""Pure-torch references (oracles) for the kernels and for applying plans; fp32, no speed goals.

Kernels compare against these:
    move_kv_ref_                 KV move for a RepackPlan (``kv[dst] = kv[src]``, gather first)
    kv_indices_ref               FlashInfer CSR triple kv_indptr / kv_indices / kv_last_page_len
    paged_decode_attention_ref   decode attention through that CSR triple over a paged cache
    attention_probs_ref          per-key attention probabilities of one decode query (score kernel)
and tests use:
    attention_ref                attention over explicit K/V with an optional keep mask
    row_attention_ref            attention over the slots of one row (token-level pool)
    apply_plan_ref               apply a RepackPlan to fake KV buffers, a row and an allocator
"""

from __future__ import annotations

from typing import Sequence

import torch

from sgl_vtoken.pages import PageAllocator
from sgl_vtoken.planner import RepackPlan


def move_kv_ref_(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In place ``kv[dst] = kv[src]`` over the first dim (slots), all sources read first.

    `dst` is unique; `src` and `dst` may overlap (in-place compaction). Any trailing shape.
    """
    # read |src| rows, write |dst| rows
    kv[dst] = kv[src].clone()


def apply_plan_ref(plan: RepackPlan, buffers: Sequence[torch.Tensor], row: torch.Tensor,
                   allocator: PageAllocator | None = None) -> int:
    """Apply `plan` to slot-indexed `buffers` (every layer's K and V), the request's 1-D
    `row` of ``req_to_token`` (rewritten in place) and `allocator`; returns the new length."""
    for buf in buffers:
        move_kv_ref_(buf, plan.src, plan.dst)
    if plan.row_slots.numel():
        row[plan.row_start:plan.new_len] = plan.row_slots.to(row.dtype)
    if allocator is not None and plan.num_freed_pages:
        allocator.free(plan.freed_pages)
    return plan.new_len


def kv_indices_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   seq_lens: torch.Tensor, page_size: int):
    """FlashInfer paged-KV metadata for the rows ``req_to_token[req_pool_indices[b], :seq_lens[b]]``.

    Rows must be page-dense. Returns int32 tensors:
        kv_indptr ``[B + 1]``: ``cumsum(ceil(seq_len / ps))`` with a leading 0;
        kv_indices ``[kv_indptr[-1]]``: page ids ``row[0:seq_len:ps] // ps`` (slots at ps 1);
        kv_last_page_len ``[B]``: ``(seq_len - 1) % ps + 1`` (0 for an empty row).
    Example, ps 16, seq_len 45: 3 pages, last page holds 13 tokens (45 = (3 - 1) * 16 + 13).
    """
    ps, lens = page_size, seq_lens.to(torch.int64)
    pages = [req_to_token[int(r), 0:int(n):ps].to(torch.int64) // ps
             for r, n in zip(req_pool_indices.tolist(), lens.tolist())]
    counts = torch.tensor([p.numel() for p in pages], dtype=torch.int64)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int64)
    indptr[1:] = counts.cumsum(0)
    indices = torch.cat(pages) if pages else torch.zeros(0, dtype=torch.int64)
    last = torch.where(lens > 0, (lens - 1) % ps + 1, torch.zeros_like(lens))
    dev = req_to_token.device
    return (indptr.to(torch.int32).to(dev), indices.to(torch.int32).to(dev),
            last.to(torch.int32).to(dev))


def _expand_gqa(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[n, Hkv, D] -> [n, Hq, D]``: query head h reads KV head ``h // (Hq // Hkv)``."""
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  keep: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Decode attention of one query ``q [Hq, D]`` over ``k, v [n, Hkv, D]`` in fp32.

    `keep` ``[n] bool`` masks evicted keys (False = masked). Returns ``[Hq, D]`` float32.
    """
    hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    kk, vv = _expand_gqa(k.float(), hq), _expand_gqa(v.float(), hq)       # [n, Hq, D]
    logits = torch.einsum("hd,nhd->hn", q.float(), kk) * scale            # [Hq, n]
    if keep is not None:
        logits = logits.masked_fill(~keep.unsqueeze(0), float("-inf"))
    return torch.einsum("hn,nhd->hd", logits.softmax(dim=-1), vv)


def attention_probs_ref(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``[n, Hkv]`` probability each key gets from one query ``q [Hq, D]``, summed over the query
    heads that share a KV head (the statistic a score kernel accumulates per slot)."""
    hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    logits = torch.einsum("hd,nhd->hn", q.float(), _expand_gqa(k.float(), hq)) * scale
    probs = logits.softmax(dim=-1)                                        # [Hq, n]
    return probs.view(k.shape[1], hq // k.shape[1], -1).sum(dim=1).T      # [n, Hkv]


def row_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                      slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention over the tokens at `slots` of a token-level pool ``k_buf [num_slots, Hkv, D]``."""
    return attention_ref(q, k_buf[slots], v_buf[slots], scale=scale)


def paged_decode_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                               kv_last_page_len: torch.Tensor,
                               scale: float | None = None) -> torch.Tensor:
    """Batched decode attention through FlashInfer's CSR triple.

    Args:
        q: ``[B, Hq, D]``; k_pages, v_pages: ``[num_pages, ps, Hkv, D]`` (NHD paged cache).
        kv_indptr ``[B+1]``, kv_indices, kv_last_page_len ``[B]``: as from :func:`kv_indices_ref`.
    Returns: ``[B, Hq, D]`` float32.
    """
    ps = k_pages.shape[1]
    out = []
    for b in range(q.shape[0]):
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        n = max(pages.numel() - 1, 0) * ps + int(kv_last_page_len[b])
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n]
        out.append(attention_ref(q[b], k, v, scale=scale))
    return torch.stack(out) if out else q.new_zeros(q.shape, dtype=torch.float32)
