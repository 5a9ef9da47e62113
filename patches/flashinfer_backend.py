"""The `vtoken_flashinfer` backend classes (`attention.py` registers them): SGLang's FlashInfer
backend and its two index updaters, planned with page ids at the real page size.

Imported only by `attention.create_vtoken_flashinfer_backend`, when SGLang builds the backend:
importing SGLang's FlashInfer backend imports FlashInfer and takes seconds, and `attention.py`
is imported in every SGLang process and on machines without SGLang (`scripts/gpu_check.sh`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from flashinfer.decode import fast_decode_plan
from sglang.srt.layers.attention import flashinfer_backend as fb
from sglang.srt.runtime_context import get_spec

from sgl_vtoken.kernels import page_indices

from .paged_kv import BACKEND_NAME, lse_to, page_indptr_host, read_kv_as_pages
from .step import scores

if TYPE_CHECKING:
    from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
    from flashinfer.prefill import (
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
    )

    from .core.sglang_types import AttentionLayer, ForwardBatch, ModelRunner


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"--attention-backend {BACKEND_NAME} does not support {what}")


def _fill_paged_indices(
    updater: PagedDecodeUpdater | PagedPrefillUpdater,
    req_pool_indices: torch.Tensor,
    lens: torch.Tensor,
    lens_sum: int,
    kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page-level CSR into SGLang's persistent buffers; returns ``(kv_indptr, kv_indices,
    last_page_len)``."""
    backend = updater.attn_backend
    bs = lens.numel()
    indptr, kv_indices, last = page_indices(
        backend.req_to_token_pool.req_to_token,
        req_pool_indices,
        lens,
        backend.page_size,
        kv_indices_out=kv_indices_out,
    )
    kv_indptr = kv_indptr[: bs + 1]
    kv_indptr.copy_(indptr)
    last_buf = updater.kv_last_page_len[:bs]
    last_buf.copy_(last)
    return kv_indptr, kv_indices, last_buf


class PagedDecodeUpdater(fb.FlashInferIndicesUpdaterDecode):
    """Decode plans over page ids at the real page size (eager and CUDA-graph buffers)."""

    def call_begin_forward(
        self,
        wrapper: BatchDecodeWithPagedKVCacheWrapper,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        kv_indptr: torch.Tensor,
        kv_start_idx: torch.Tensor | None,
        spec_info: object,
        seq_lens_cpu: torch.Tensor | None,
        use_sliding_window_kv_pool: bool = False,
        fixed_split_size: int | None = None,
        disable_split_kv: bool | None = None,
        *,
        plan: object,
        req_pool_indices: torch.Tensor,
    ) -> None:
        if spec_info is not None:
            raise _unsupported("speculative decoding")
        if kv_start_idx is not None or use_sliding_window_kv_pool:
            raise _unsupported("sliding-window attention")
        if wrapper.is_cuda_graph_enabled:
            out = wrapper._paged_kv_indices_buf  # sized for tokens >= pages
        else:
            out = torch.empty(
                max(paged_kernel_lens_sum, 1), dtype=torch.int32, device=paged_kernel_lens.device
            )
        kv_indptr, kv_indices, last = _fill_paged_indices(
            self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, kv_indptr, out
        )
        kwargs = dict(
            data_type=self.data_type,
            q_data_type=self.q_data_type,
            non_blocking=True,
            fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv if disable_split_kv is not None else False,
        )
        if (
            getattr(wrapper.begin_forward, "func", None) is fast_decode_plan
            and seq_lens_cpu is not None
        ):
            kwargs["global_override_indptr_cpu"] = page_indptr_host(
                seq_lens_cpu, self.attn_backend.page_size
            )
        wrapper.begin_forward(
            kv_indptr, kv_indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim,
            self.attn_backend.page_size, **kwargs,
        )  # fmt: skip


class PagedPrefillUpdater(fb.FlashInferIndicesUpdaterPrefill):
    """Extend plans: a paged prefix (or the whole row) plus, if ragged, the new tokens."""

    def call_begin_forward(
        self,
        wrapper_ragged: BatchPrefillWithRaggedKVCacheWrapper,
        wrapper_paged: BatchPrefillWithPagedKVCacheWrapper,
        req_pool_indices: torch.Tensor,
        paged_kernel_lens: torch.Tensor,
        paged_kernel_lens_sum: int,
        seq_lens: torch.Tensor,
        prefix_lens: torch.Tensor,
        kv_start_idx: torch.Tensor | None,
        kv_indptr: torch.Tensor,
        qo_indptr: torch.Tensor,
        use_ragged: bool,
        spec_info: object,
        use_sliding_window_kv_pool: bool = False,
        fixed_split_size: int | None = None,
        multi_item_params: fb.MultiItemScoringParams | None = None,
        cross_attention_custom_mask: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
        custom_kv_indices: torch.Tensor | None = None,
        window_left: int = -1,
        *,
        plan: object,
    ) -> None:
        if spec_info is not None:
            raise _unsupported("speculative decoding or verify")
        if kv_start_idx is not None or use_sliding_window_kv_pool or window_left >= 0:
            raise _unsupported("sliding-window attention")
        if multi_item_params is not None and multi_item_params.is_enabled():
            raise _unsupported("multi-item scoring")
        if cross_attention_custom_mask is not None:
            raise _unsupported("cross attention")
        if custom_kv_indices is not None:
            raise _unsupported("dequantizing KV-cache workspaces")
        bs = seq_lens.numel()
        out = torch.empty(paged_kernel_lens_sum + 256, dtype=torch.int32, device=seq_lens.device)
        kv_indptr, kv_indices, last = _fill_paged_indices(
            self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, kv_indptr, out
        )
        qo_indptr[1 : bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)
        qo_indptr = qo_indptr[: bs + 1]
        if use_ragged:  # new tokens attend to themselves through the ragged wrapper
            wrapper_ragged.begin_forward(
                qo_indptr, qo_indptr, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                q_data_type=self.q_data_type,
            )  # fmt: skip
        wrapper_paged.begin_forward(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.attn_backend.page_size,
            q_data_type=self.q_data_type,
            kv_data_type=self.data_type,
            custom_mask=None,
            non_blocking=True,
            fixed_split_size=fixed_split_size,
        )


def _paged(create: str) -> Callable[..., list[Any]]:
    """The override of SGLang's wrapper factory `create` (``_create_*_wrappers``): the wrappers
    it makes, each reading the KV as pages of the backend's page size (`read_kv_as_pages`)."""

    def created(self: VTokenFlashInferAttnBackend, *args: Any, **kwargs: Any) -> list[Any]:
        made = getattr(super(VTokenFlashInferAttnBackend, self), create)(*args, **kwargs)
        return [read_kv_as_pages(w, self.page_size) for w in made]

    return created


class VTokenFlashInferAttnBackend(fb.FlashInferAttnBackend):
    """FlashInfer planned at SGLang's page size over page-dense rows."""

    def __init__(self, model_runner: ModelRunner, **kwargs: Any) -> None:
        super().__init__(model_runner, **kwargs)
        for bad, what in (
            (self.dispatch_reason is not None, "sliding-window or cross attention"),
            (get_spec().speculative_algorithm is not None, "speculative decoding"),
            (self.is_dllm_model, "dLLM models"),
            (self.enable_mis, "multi-item scoring"),
            (
                self.prefill_uses_dequant_workspace or self.decode_uses_dequant_workspace,
                "dequantizing KV caches",
            ),
            (self.kv_index_translator.is_translating, "translated KV indices (unified allocators)"),
        ):
            if bad:
                raise _unsupported(what)
        self.indices_updater_decode = PagedDecodeUpdater(model_runner, self)
        if not self.skip_prefill:
            self.indices_updater_prefill = PagedPrefillUpdater(model_runner, self)
        for w in self.decode_wrappers + self.prefill_wrappers_paged:
            read_kv_as_pages(w, self.page_size)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """When this layer's decode is scored (H2O, TOVA, Scissorhands), FlashInfer also returns its
        LSE, which the score launch reads instead of recomputing it (one read of K, not two)."""
        if not scores.wants_lse(layer.layer_id):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        wrapper = self.forward_metadata.decode_wrappers[self._get_wrapper_idx(layer)]
        with lse_to(wrapper, lambda lse: scores.offer_lse(layer.layer_id, lse, "log2")):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    # The wrappers SGLang makes for CUDA graphs, paged like those of __init__.
    _create_decode_wrappers = _paged("_create_decode_wrappers")
    _create_prefill_wrappers = _paged("_create_prefill_wrappers")
    _create_full_cg_prefill_wrappers = _paged("_create_full_cg_prefill_wrappers")
