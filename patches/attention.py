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
`flashinfer_backend.py`, imported when SGLang builds the backend; the page views both use are in
`paged_kv.py`.
"""

from __future__ import annotations

from .paged_kv import BACKEND_NAME


def register_attention_backend() -> None:
    """Register `vtoken_flashinfer` in SGLang's backend registry and CLI choices (idempotent)."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention import attention_registry

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    attention_registry.register_attention_backend(BACKEND_NAME)(create_vtoken_flashinfer_backend)


def create_vtoken_flashinfer_backend(runner):
    """Registry factory: SGLang calls it with the ModelRunner."""
    if runner.use_mla_backend:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} supports MHA models only; use 'flashinfer' for MLA"
        )
    from .flashinfer_backend import (
        VTokenFlashInferAttnBackend,
    )  # slow, needs FlashInfer: see its docstring

    return VTokenFlashInferAttnBackend(runner, init_new_workspace=runner.init_new_workspace)
