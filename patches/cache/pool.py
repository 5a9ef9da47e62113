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

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req


def alloc(
    tree: RadixTree, n: int, req: Req | None = None, kind: str = "copies"
) -> torch.Tensor | None:
    """``[n]`` slots (whole pages: `n` is a multiple of the page size) from the pool of the
    radix cache `tree`, evicting its unlocked nodes if needed, for `req` (None: no request) and
    what they hold (`kind`, `core/shortage.KINDS`); None when the pool cannot give them. Callers
    look it up as `pool.alloc` when they call (a test that forces shortages replaces it)."""
    allocator = tree.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        tree.evict(EvictParams(num_tokens=n))
    return allocator.alloc(n) if allocator.available_size() >= n else None
