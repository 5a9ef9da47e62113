"""`page_indices`: FlashInfer's paged-KV CSR triple for page-dense rows of `req_to_token`.

Validates its arguments (no device sync unless `check=True`), then runs the Triton launcher of
`page_index.py` (imported on first use) or the torch oracle `reference.page_indices_ref`.
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import reference as ref


def page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    num_pages: int | None = None,
    kv_indices_out: torch.Tensor | None = None,
    impl: str | None = None,
    check: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer paged-KV indices (kv_indptr, kv_indices, kv_last_page_len) of page-dense rows.

    Args:
        req_to_token: [max_reqs, max_ctx] int32/int64 slot table (SGLang's `ReqToTokenPool`).
        req_pool_indices: [bs] int32/int64 row of each request.
        seq_lens: [bs] int32/int64 row lengths (0 allowed).
        page_size: tokens per page P >= 1. Rows must be page-dense: position i of a row holds slot
            page_id * P + i % P, with the page id shared by positions of one page (`check=True`
            verifies it, with a host sync).
        num_pages: total pages (sum of ceil(seq_lens / P)) if the caller knows it, avoiding a
            host sync; else computed from seq_lens.
        kv_indices_out: optional preallocated [>= total pages] int32 buffer (e.g. the CUDA-graph
            index buffer); it is filled and returned whole (only kv_indptr[-1] entries are valid)
            unless num_pages is given.
        impl: "triton", "torch", or None (Triton on CUDA, torch otherwise).

    Returns:
        kv_indptr [bs+1] int32, kv_indices int32 (page id = first slot of the page // P) and
        kv_last_page_len [bs] int32 (1..P, 0 for an empty row), as FlashInfer's paged wrappers take
        them with page_size=P (`flashinfer.page.get_seq_lens` gives seq_lens back).
    """
    C.check_tensor(req_to_token, "req_to_token")
    C.check_ndim(req_to_token, "req_to_token", 2, "[max_reqs, max_ctx]")
    C.check_dtype(req_to_token, "req_to_token", C.INDEX_DTYPES)
    device = req_to_token.device
    C.check_index_vector(req_pool_indices, "req_pool_indices", device, "req_to_token")
    bs = req_pool_indices.numel()
    C.check_index_vector(seq_lens, "seq_lens", device, "req_to_token", numel=bs)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if kv_indices_out is not None:
        C.check_tensor(kv_indices_out, "kv_indices_out")
        C.check_ndim(kv_indices_out, "kv_indices_out", 1, "[>= total pages]")
        C.check_dtype(kv_indices_out, "kv_indices_out", (torch.int32,))
        C.check_device(kv_indices_out, "kv_indices_out", device, "req_to_token")
        if kv_indices_out.numel() > 1 and kv_indices_out.stride(0) != 1:
            raise ValueError(
                f"kv_indices_out must be contiguous, got stride {kv_indices_out.stride(0)}"
            )
    impl = C.resolve_impl(impl, device)
    if check:
        _check_rows(req_to_token, req_pool_indices, seq_lens, page_size)
    if kv_indices_out is None:
        if num_pages is None:
            num_pages = _total_pages(seq_lens, page_size)
        kv_indices = torch.empty(num_pages, dtype=torch.int32, device=device)
    else:
        if num_pages is None and check:
            num_pages = _total_pages(seq_lens, page_size)
        if num_pages is not None and kv_indices_out.numel() < num_pages:
            raise ValueError(
                f"kv_indices_out holds {kv_indices_out.numel()} entries "
                f"but the batch has {num_pages} pages"
            )
        kv_indices = kv_indices_out
    if impl == "torch":
        indptr, ids, last = ref.page_indices_ref(
            req_to_token, req_pool_indices, seq_lens, page_size
        )
        if ids.numel() > kv_indices.numel():
            raise ValueError(
                f"kv_indices_out holds {kv_indices.numel()} entries "
                f"but the batch has {ids.numel()} pages"
            )
        kv_indices[: ids.numel()] = ids
    else:
        indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
        last = torch.empty(bs, dtype=torch.int32, device=device)
        C.triton_module("page_index").launch_page_indices(
            req_to_token,
            req_pool_indices.contiguous(),
            seq_lens.contiguous(),
            page_size,
            indptr,
            kv_indices,
            last,
        )
    if kv_indices_out is not None and num_pages is not None:
        kv_indices = kv_indices[:num_pages]
    return indptr, kv_indices, last


def _total_pages(seq_lens: torch.Tensor, page_size: int) -> int:
    """sum(ceil(seq_lens / page_size)) (a host sync)."""
    return int(((seq_lens.long() + page_size - 1) // page_size).sum())


def _check_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    max_reqs, max_ctx = req_to_token.shape
    if req_pool_indices.numel():
        lo, hi = int(req_pool_indices.min()), int(req_pool_indices.max())
        if lo < 0 or hi >= max_reqs:
            raise ValueError(
                f"req_pool_indices holds rows in [{lo}, {hi}], outside [0, {max_reqs})"
            )
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > max_ctx:
            raise ValueError(f"seq_lens holds lengths in [{lo}, {hi}], outside [0, {max_ctx}]")
    check_page_dense(req_to_token, req_pool_indices, seq_lens, page_size)


def check_page_dense(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """Every page of every row starts at a page boundary and holds consecutive slots (syncs)."""
    for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        row = req_to_token[int(r), : int(n)].long()
        pos = torch.arange(int(n), device=row.device)
        first = row[pos - pos % page_size]
        bad = (row != first + pos % page_size) | (first % page_size != 0)
        if bool(bad.any()):
            p = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"row {int(r)} (batch entry {b}) is not page-dense at position {p}: "
                f"slot {int(row[p])}, page starts at slot {int(first[p])}, page_size {page_size}"
            )
