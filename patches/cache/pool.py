"""Pages the plugin takes from SGLang's KV pool on a request's behalf (copies of kept tree-owned
tokens, a stored view's partial last page, a retracted row written back, recalled tokens).

Every such allocation goes through `alloc`: free pages first, then unlocked radix-cache nodes
evicted to make room, and None (never an exception) when the pool cannot give them; the caller
defers, blocks or ends the request and counts it (`core/shortage.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from ..core.process import process

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req


def alloc(
    tree: RadixTree, n: int, req: Req | None = None, kind: str = "copies"
) -> torch.Tensor | None:
    """``[n]`` slots (whole pages: `n` is a multiple of the page size) from the pool of the
    radix cache `tree`, evicting its unlocked nodes if needed; None when the pool cannot give
    them, or when a test refuses pages of `kind` for `req` (`Shortages.refused`)."""
    if req is not None and process().shortages.refused(req, kind):
        return None
    allocator = tree.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        tree.evict(EvictParams(num_tokens=n))
    return allocator.alloc(n) if allocator.available_size() >= n else None
