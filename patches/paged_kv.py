"""SGLang's [rows, H, D] KV buffers read as FlashInfer pages [rows / P, P, H, D]: the views and
host index arrays shared by the backend's registration (`attention.py`) and its classes
(`flashinfer_backend.py`). Imports neither SGLang nor FlashInfer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch

BACKEND_NAME = "vtoken_flashinfer"

# A paged KV cache as FlashInfer's `run` takes it: a (K, V) pair, or one tensor.
PagedKV = torch.Tensor | Sequence[torch.Tensor]


class Wrapper(Protocol):
    """What is patched of a FlashInfer paged wrapper (`BatchDecodeWithPagedKVCacheWrapper`,
    `BatchPrefillWithPagedKVCacheWrapper`): its `run` methods, replaced on the instance."""

    run: Callable[..., Any]
    run_return_lse: Callable[..., Any]


W = TypeVar("W", bound=Wrapper)


def as_pages(kv_cache: PagedKV, page_size: int) -> PagedKV:
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


def read_kv_as_pages(wrapper: W, page_size: int) -> W:
    """Make a FlashInfer paged wrapper accept SGLang's [rows, H, D] buffers at page size P."""
    if page_size == 1 or getattr(wrapper.run, "page_size", None) == page_size:
        return wrapper  # already reads pages of this size
    run = wrapper.run

    def paged_run(q: torch.Tensor, paged_kv_cache: PagedKV, *args: Any, **kwargs: Any) -> Any:
        return run(q, as_pages(paged_kv_cache, page_size), *args, **kwargs)

    paged_run.page_size = page_size  # type: ignore[attr-defined]  # marks the wrapped `run`
    wrapper.run = paged_run
    wrapper.run_return_lse = functools.partial(paged_run, return_lse=True)
    return wrapper


@contextmanager
def lse_to(wrapper: Wrapper, sink: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While in it, FlashInfer's decode `wrapper.run` also returns the log-sum-exp (``[bs, hq]``
    float32, base 2), hands it to `sink(lse)` and returns the attention output as before."""
    own, run = "run" in vars(wrapper), wrapper.run

    def run_keeping_lse(*args: Any, **kwargs: Any) -> Any:
        out, lse = run(*args, return_lse=True, **kwargs)
        sink(lse)
        return out

    wrapper.run = run_keeping_lse
    try:
        yield
    finally:
        if own:
            wrapper.run = run
        else:
            del wrapper.run


def page_indptr_host(seq_lens_cpu: torch.Tensor, page_size: int) -> torch.Tensor:
    """Host copy of the paged kv_indptr ([bs+1] int32), for FlashInfer's sync-free replans."""
    pages = (seq_lens_cpu.long() + page_size - 1) // page_size
    out = torch.zeros(pages.numel() + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(pages, 0)
    return out
