"""Triton builder of FlashInfer's paged-KV indices from SGLang's `req_to_token` rows.

For page-dense rows (page p of a row holds slots page_id*P .. page_id*P + P-1, in order):

    kv_indptr[b+1]      = kv_indptr[b] + ceil(seq_lens[b] / P)
    kv_indices[...]     = req_to_token[row_b, 0 : seq_lens[b] : P] // P     (page ids)
    kv_last_page_len[b] = seq_lens[b] - (num_pages_b - 1) * P   (1..P; 0 for an empty row)

Two launches, no host sync: one program scans the lengths, then one per (request, split)
gathers page ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks as C


# Kernel parameters stay unannotated: Triton reads their annotations (tl.constexpr).
@triton.jit
def _page_indptr_kernel(  # type: ignore[no-untyped-def]
    # Inputs
    seq_lens_ptr,  # [bs] int32/int64
    bs,
    # Outputs
    kv_indptr_ptr,  # [bs + 1] int32
    last_page_len_ptr,  # [bs] int32
    # Constants
    PAGE: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    carry = 0
    tl.store(kv_indptr_ptr, carry)
    for b0 in range(0, bs, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        mask = offs < bs
        n = tl.load(seq_lens_ptr + offs, mask=mask, other=0).to(tl.int32)
        pages = (n + PAGE - 1) // PAGE
        tl.store(kv_indptr_ptr + 1 + offs, tl.cumsum(pages, axis=0) + carry, mask=mask)
        tl.store(last_page_len_ptr + offs, tl.where(n > 0, n - (pages - 1) * PAGE, 0), mask=mask)
        carry += tl.sum(pages, axis=0)


@triton.jit
def _page_ids_kernel(  # type: ignore[no-untyped-def]
    # Inputs
    req_to_token_ptr,  # [max_reqs, max_ctx] int32 slot ids
    stride_row,
    stride_col,
    req_pool_indices_ptr,  # [bs] int32/int64
    seq_lens_ptr,  # [bs] int32/int64
    kv_indptr_ptr,  # [bs + 1] int32 (from _page_indptr_kernel)
    # Outputs
    kv_indices_ptr,  # [>= kv_indptr[bs]] int32 page ids
    # Constants
    PAGE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    row = req_to_token_ptr + tl.load(req_pool_indices_ptr + b).to(tl.int64) * stride_row
    num_pages = (tl.load(seq_lens_ptr + b).to(tl.int32) + PAGE - 1) // PAGE
    out = kv_indices_ptr + tl.load(kv_indptr_ptr + b).to(tl.int64)
    for p0 in range(split * BLOCK_P, num_pages, SPLITS * BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        mask = offs < num_pages
        first_slot = tl.load(row + (offs.to(tl.int64) * PAGE) * stride_col, mask=mask, other=0)
        tl.store(out + offs, (first_slot // PAGE).to(tl.int32), mask=mask)


def launch_page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    splits: int | None = None,
) -> None:
    """Fill the three preallocated outputs (validated by `sgl_vtoken.kernels.page_indices`)."""
    device = req_to_token.device
    interpreted = C.interpreted(_page_ids_kernel, device, "page_index")
    bs = req_pool_indices.numel()
    block_b = 1024 if not interpreted else 16
    _page_indptr_kernel[(1,)](
        seq_lens, bs, kv_indptr, kv_last_page_len, PAGE=page_size, BLOCK_B=block_b
    )
    if bs == 0:
        return
    if splits is None:
        splits = 2 if interpreted else 4
    block_p = 16 if interpreted else 128
    _page_ids_kernel[(bs, splits)](
        req_to_token,
        req_to_token.stride(0),
        req_to_token.stride(1),
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_indices,
        PAGE=page_size,
        BLOCK_P=block_p,
        SPLITS=splits,
    )
