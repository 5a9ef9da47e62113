"""`vtoken_flashinfer`: SGLang's FlashInfer attention backend planned with the real page size.

`register_attention_backend()` makes `--attention-backend vtoken_flashinfer` available. Rows kept
page-dense are planned as real pages (`kv_indices` lists page ids from
`sgl_vtoken.kernels.page_indices`, no host sync) instead of stock SGLang's one-token pages. SGLang
is imported only inside functions, so importing this module is cheap; the backend classes are in
`flashinfer_backend.py`, imported when SGLang builds the backend; the page views both use are in
`paged_kv.py`. What it covers and rejects: docs/design/splice.md, "The `vtoken_flashinfer` backend".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .paged_kv import BACKEND_NAME

if TYPE_CHECKING:
    from .core.sglang_types import ModelRunner
    from .flashinfer_backend import VTokenFlashInferAttnBackend


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


def create_vtoken_flashinfer_backend(runner: ModelRunner) -> VTokenFlashInferAttnBackend:
    """Registry factory: SGLang calls it with the ModelRunner."""
    if runner.use_mla_backend:
        raise ValueError(
            f"--attention-backend {BACKEND_NAME} supports MHA models only; use 'flashinfer' for MLA"
        )
    from .flashinfer_backend import (
        VTokenFlashInferAttnBackend,
    )  # slow, needs FlashInfer: see its docstring

    return VTokenFlashInferAttnBackend(runner, init_new_workspace=runner.init_new_workspace)
