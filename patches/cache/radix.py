"""Radix cache with holes (`--radix-cache-backend vtoken`, chosen automatically with a server
policy): SGLang's Python `RadixCache` whose nodes may hold holes (value -1 where a token was
evicted), so evicting requests share their prompts, drop shared tokens from their own view, and
leave their compacted history in the tree for a next turn to continue from.

Keys stay the full logical ids; holed nodes live under a namespace per eviction setting, so
every other request is served exactly as by `RadixCache`. Sizes count live slots, so SGLang's
pool checkers hold. A request's match is `prefix.py`'s (its result, `st.prefix`); histories are
stored by `history.py` (page size 1) and `history_pages.py` (page size > 1); the step's lock moves
on a request's hole-free prompt path are here (`detach_own`, `relock_shallower`). Design:
docs/design/cache.md, "Prefix sharing under eviction".
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from ..core.process import process
from ..core.state import state_of
from . import history, history_pages, host_history, prefix

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from sgl_vtoken.config import EvictConfig

    from ..core.sglang_types import Req, TreeNode
    from ..core.state import ReqEvictState

NAME = "vtoken"


def tree_mode(cfg: EvictConfig) -> bool:
    """Whether a request under `cfg` is served by this cache's paths: its prompt is shared,
    tree-owned tokens may leave its row, and (`reuse_history`) its history is stored.
    Naive-Evict takes them too (same caching, same victims; only its footprint differs)."""
    return process().holed and cfg.enabled


def _whole_view(req: Req, st: ReqEvictState) -> bool:
    """A finished pressure-trigger row that never evicted is stored as a view without holes in
    its history namespace when it offloads (instead of SGLang's plain insert), so that when the
    tree's LRU evicts it, it moves to host memory whole, like any stored view
    (`host_history.offload_view`), and its next turn restores it."""
    return req.finished() and st.cfg.on_pressure and st.cfg.host.offload and st.cfg.history.reuse


def factory(ctx: TreeCacheBuildContext) -> HoledRadixCache:
    """`register_radix_cache_backend` factory."""
    for bad, why in (
        (ctx.disable_radix_cache, "--disable-radix-cache"),
        (ctx.is_hybrid_swa or ctx.is_hybrid_ssm, "hybrid SWA / Mamba models"),
        (ctx.enable_hierarchical_cache, "--enable-hierarchical-cache"),
    ):
        if bad:
            raise ValueError(f"--radix-cache-backend {NAME} cannot run with {why}")
    return HoledRadixCache(ctx.params)


class HoledRadixCache(RadixCache):
    """`RadixCache` whose holed nodes (`node.vt`, `history.NodeRecord`) count only live slots."""

    # --- sizes count live slots -----------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                n = history.live(node)
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, params: object = None) -> DecLockRefResult:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                n = history.live(node)
                self.evictable_size_ += n
                self.protected_size_ -= n
                delta += n
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        new_node = super()._split_node(key, child, split_len)
        history.split(new_node, child)  # a holed node's front part is holed too
        return new_node

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        self.evictable_size_ += len(node.key) - history.live(node)
        if (tier := process().tier) is not None:
            tier.detach(node)  # the view's host store goes with it

    def reset(self) -> None:
        super().reset()
        if (tier := process().tier) is not None:
            tier.reset()

    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            if history.record_of(x) is None:  # hole-free: page-exact segment, as stock
                self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
                evicted += len(x.value)
            else:
                host_history.offload_view(self, x)  # offload on: its view moves to the host
                live = history_pages.owned(x)
                live = x.value[x.value >= 0] if live is None else live.to(self.device)
                self.token_to_kv_pool_allocator.free(live)
                evicted += int(live.numel())
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
            self.kv_events.record_remove(x)
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def total_size(self) -> int:
        return int(self.all_values_flatten().numel())

    def all_values_flatten(self) -> torch.Tensor:
        values, stack = [torch.zeros(0, dtype=torch.int64, device=self.device)], [self.root_node]
        while stack:
            for child in stack.pop().children.values():
                pages = history_pages.owned(child)
                values.append(
                    child.value[child.value >= 0] if pages is None else pages.to(self.device)
                )
                stack.append(child)
        return torch.cat(values)

    # --- matching (`prefix.py`) -----------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        return prefix.match_prefix(self, params)

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        return prefix.prefix_device_indices(self, req)

    # --- inserting ------------------------------------------------------------------------------
    def checkpoint(self, req: Req, *, up_to: int) -> None:
        st = state_of(req)
        if st is None or not st.holed:
            return super().checkpoint(req, up_to=up_to)
        if st.row.steps == 0 and st.prefix.hit is None and not _whole_view(req, st):
            return super().checkpoint(req, up_to=up_to)  # contiguous, full attention: stock
        if req.finished() and st.cfg.history.reuse:
            if st.retract.resume_node is not None or st.prefix.restored is not None:
                # a resumed or restored row lives in a namespace of its own: to host memory
                host_history.store_row(self, req, st, up_to)
            elif self.page_size > 1:
                history_pages.insert(self, req, st, up_to)
            else:
                history.insert_history(self, req, st, up_to)
            counters = process().counters
            if st.report.history_tokens is not None:
                counters.history_hits += 1
                counters.history_tokens_reused += st.report.history_tokens

    def release_dropped(self, req: Req, dropped: torch.Tensor) -> int:
        """Free the slots at the logical positions `dropped` (host) that `req`'s eviction dropped
        and only its row can reach (`history.py`)."""
        return history.release_dropped(self, req, dropped)

    def release_unused_pages(self, req: Req, kept_pages: torch.Tensor) -> int:
        """Page size > 1: free the pages of `req`'s stored view that its row no longer uses (it
        keeps the tree pages `kept_pages`, host) and only it can reach (`history_pages.py`).
        Returns the pages freed."""
        return history_pages.release_unused(self, req, kept_pages)

    def detach_own(self, req: Req, depth: int, length: int) -> torch.Tensor | None:
        """Take the hole-free path of `req`'s lock below logical `depth` out of the tree when
        only `req` holds it (locked by it alone, no other branch) and it is `length` tokens
        long: its slots become the request's own, and its lock moves up to `depth`. Returns
        those slots ``[length] int64`` in logical order, or None (nothing changes) when anyone
        else could reach them or the path is not `length` long."""
        node = req.last_node
        chain: list[TreeNode] = []
        if node is None or node is self.root_node:
            return None
        end = 0
        a = node
        while a is not self.root_node:
            end, a = end + len(a.key), a.parent
        if end <= depth or end - depth != length:
            return None
        at = end
        while node is not self.root_node and at > depth:
            sole = len(node.children) == (1 if chain else 0)
            if node.lock_ref != 1 or not sole or history.record_of(node) is not None:
                return None
            chain.append(node)
            at -= len(node.key)
            node = node.parent
        if at < depth:  # `depth` falls inside the shallowest node: split it there
            top = chain.pop()
            self._split_node(top.key, top, depth - at)
            chain.append(top)
        slots = torch.cat([n.value for n in reversed(chain)]).to(torch.int64)
        self.unlock(req.lock)
        for n in chain:  # deepest first: each is a leaf when deleted
            self._delete_leaf(n)
        parent = chain[-1].parent
        req.lock, req.last_node = self.lock(parent), parent
        return slots

    def relock_shallower(self, req: Req, need: int) -> None:
        """Move `req`'s lock on a hole-free path up to the shallowest node that still covers the
        first `need` tokens of the path, splitting at a page boundary: the deeper part of the
        prompt then belongs to whoever else holds it, or becomes evictable."""
        node = req.last_node
        if node is None or node is self.root_node or history.record_of(node) is not None:
            return
        need = -(-need // self.page_size) * self.page_size
        depth, a = 0, node
        while a is not self.root_node:
            depth, a = depth + len(a.key), a.parent
        if need >= depth:
            return
        while node is not self.root_node and depth - len(node.key) >= need:
            depth -= len(node.key)
            node = node.parent
        if depth > need:  # `need` falls inside `node`: split it there
            node = self._split_node(node.key, node, need - (depth - len(node.key)))
        lock = self.lock(node)
        self.unlock(req.lock)
        req.lock, req.last_node = lock, node
