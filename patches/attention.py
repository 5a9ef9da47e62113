"""`vtoken_flashinfer`: SGLang's FlashInfer attention backend planned with the real page size.

Stock SGLang 0.5.23 plans FlashInfer at page size 1: `kv_indices` lists every token slot and each
layer's KV buffer [rows, H, D] is read as `rows` pages of one token. Rows kept page-dense (the
slot of row position i is page_id * P + i % P, which vToken's in-place compaction preserves) can
be planned as real pages instead: `kv_indices` lists page ids (P times fewer indices to build and
read), `kv_last_page_len` holds the fill of each row's last page, and the buffers are viewed as
[rows / P, P, H, D]. The indices come from `sgl_vtoken.kernels.page_indices` (Triton on CUDA,
no host sync).

Covered: MHA models with full attention; decode (eager and CUDA graphs) and extend (paged, or
ragged new tokens plus a paged prefix). Rejected when the backend is built, with the reason:
sliding-window or cross attention, speculative decoding, dLLM, multi-item scoring, dequantizing
KV-cache workspaces (FP4), translated KV indices (unified allocators), MLA.

`register_attention_backend()` makes `--attention-backend vtoken_flashinfer` available; SGLang
is imported only inside functions, so importing this module is cheap. The backend classes are in
`flashinfer_backend.py`, imported when SGLang builds the backend.
"""

from __future__ import annotations

import functools

import torch

BACKEND_NAME = "vtoken_flashinfer"


def register_attention_backend() -> None:
    """Register `vtoken_flashinfer` in SGLang's backend registry and CLI choices (idempotent)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention import attention_registry

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    attention_registry.register_attention_backend(BACKEND_NAME)(create_vtoken_flashinfer_backend)


def create_vtoken_flashinfer_backend(runner):
    """Registry factory: SGLang calls it with the ModelRunner."""
    if runner.use_mla_backend:
        raise ValueError(f"--attention-backend {BACKEND_NAME} supports MHA models only; use 'flashinfer' for MLA")
    from .flashinfer_backend import VTokenFlashInferAttnBackend  # slow, needs FlashInfer: see its docstring

    return VTokenFlashInferAttnBackend(runner, init_new_workspace=runner.init_new_workspace)


def as_pages(kv_cache, page_size: int):
    """View a (K, V) pair of [rows, H, D] buffers as FlashInfer NHD pages [rows / P, P, H, D]."""
    if page_size == 1 or not isinstance(kv_cache, (tuple, list)):
        return kv_cache
    out = []
    for t in kv_cache:
        if t.ndim != 3:
            return kv_cache  # already paged
        rows, heads, dim = t.shape
        if rows % page_size:
            raise ValueError(f"KV buffer has {rows} rows, not a multiple of page_size {page_size}")
        out.append(t.view(rows // page_size, page_size, heads, dim))
    return tuple(out)


def read_kv_as_pages(wrapper, page_size: int):
    """Make a FlashInfer paged wrapper accept SGLang's [rows, H, D] buffers at page size P."""
    if page_size == 1 or getattr(wrapper, "_vtoken_page_size", None) == page_size:
        return wrapper
    run = wrapper.run

    def paged_run(q, paged_kv_cache, *args, **kwargs):
        return run(q, as_pages(paged_kv_cache, page_size), *args, **kwargs)

    wrapper.run = paged_run
    wrapper.run_return_lse = functools.partial(paged_run, return_lse=True)
    wrapper._vtoken_page_size = page_size
    return wrapper


def page_indptr_host(seq_lens_cpu: torch.Tensor, page_size: int) -> torch.Tensor:
    """Host copy of the paged kv_indptr ([bs+1] int32), for FlashInfer's sync-free replans."""
    pages = (seq_lens_cpu.long() + page_size - 1) // page_size
    out = torch.zeros(pages.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(pages, 0)
    return out
