"""Radix cache with holes (`--radix-cache-backend vtoken`, chosen automatically with a server
policy): SGLang's Python `RadixCache` whose nodes may hold holes (value -1 where a token was
evicted), so evicting requests share their prompts, drop shared tokens from their own view, and
leave their compacted history in the tree for a next turn to continue from.

Keys stay the full logical ids; holed nodes live under a namespace per eviction setting, so
every other request is served exactly as by `RadixCache`. Sizes count live slots, so SGLang's
pool checkers hold. A request's match is its `Prefix` (`st.prefix`); histories are stored by
`history.py` (page size 1) and `history_pages.py` (page size > 1). Design: docs/design/cache.md,
"Prefix sharing under eviction".
"""

from __future__ import annotations

import heapq
import time
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

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
from . import history, history_pages, host_history

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


class ViewHit(NamedTuple):
    """The stored view a request's row starts as: its radix `node`, its KV ``slots [m] int64``,
    and whether they end in the request's own copy of the view's partial last page (`copied`,
    page size > 1)."""

    node: TreeNode
    slots: torch.Tensor
    copied: bool = False


@dataclass
class Prefix:
    """What a request's row starts from (`st.prefix`): a stored view (`hit`, None: a plain
    prefill) and `attach`, the logical prefix whose KV is hole-free (full attention)."""

    hit: ViewHit | None = None
    attach: int = 0
    # A plain prefill's prompt tokens the tree held when its first chunk was matched: the rest
    # is the request's own, which its eviction copies out of the tree (`step/eviction.py`);
    # None: not a plain prefill's match.
    matched: int | None = None
    restored: TreeNode | None = None  # the leaf a host history was restored to for it
    restore_blocked: bool = False  # a host history it continues does not fit the pool yet

    def continue_from(
        self, node: TreeNode | None, slots: torch.Tensor | None, attach: int, copied: bool = False
    ) -> None:
        """The row starts as the stored view at radix `node`, whose KV is at `slots` (`node`
        None: no view); `attach`: the logical prefix whose KV is hole-free; `copied`: `slots` end
        in the request's own copy of the view's partial last page (page size > 1)."""
        if node is None:
            self.hit = None
        else:
            assert slots is not None, "a stored view's row has slots"
            self.hit = ViewHit(node, slots, copied)
        self.attach = attach

    def cap_attach(self, done: int) -> None:
        """The KV past logical position `done` saw a compacted row (an eviction during the
        prefill): the hole-free prefix ends there at the latest."""
        self.attach = min(self.attach, done)

    def clear(self) -> None:
        """The row no longer continues a view (it is gone, or back to the logical ids)."""
        self.hit = None


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

    # --- matching -------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        st = state_of(req) if req is not None else None
        if st is None or not st.holed:
            return self._observed(super().match_prefix(params), params.key, st)
        logical = history.restore(req, st)
        limit = req._compute_max_prefix_len(len(logical))
        key = RadixKey(logical, req.extra_key, cache_salt=req.cache_salt, limit=limit)
        result = super().match_prefix(MatchPrefixParams(key=key))
        st.prefix.continue_from(None, None, len(logical))  # no view yet: a plain prefill
        if not req.kv.holds_kv:
            st.prefix.matched = None
        st.prefix.restore_blocked = False
        if st.retract.stash is not None:  # retracted after evicting: resume from its row
            return st.retract.resume(self, req, st, logical, limit, result)
        if (
            not st.cfg.history.reuse
            or req.output_ids
            or (req.return_logprob and req.logprob_start_len >= 0)
        ):
            return self._plain(req, st, result, key)  # retracted (re-prefilled whole) or logprobs
        found = history.find_view(
            self, result.last_device_node, logical, limit, history.namespace(req, st)
        )
        floor = max(result.device_prefix_len, found[1] if found is not None else 0)
        restored = self._from_host(req, st, logical, limit, floor)
        if st.prefix.restore_blocked:  # the pool may have evicted nodes of `result` meanwhile
            result = super().match_prefix(MatchPrefixParams(key=key))
        if restored is not None:
            found = restored
        if found is None or found[1] <= result.device_prefix_len:
            st.report.history_from("none")
            return self._plain(req, st, result, key)
        node, depth = found
        positions, slots = history.cut_view(node, depth)
        history.adopt(req, st, logical, positions, depth)
        st.prefix.continue_from(node, slots, node.vt.view.attach)
        st.report.history_from("host" if restored else "device", len(positions) if restored else 0)
        # At page size > 1 the view's partial last page becomes the request's own (own_tail).
        return MatchResult(
            device_prefix_len=len(positions),
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            cache_protected_len=len(positions) // self.page_size * self.page_size,
        )

    def _from_host(
        self, req: Req, st: ReqEvictState, logical: array, limit: int, floor: int
    ) -> tuple[TreeNode, int] | None:
        """The host history `logical[:limit]` continues past depth `floor`, restored to the
        device (`host_history.py`; once: a later round of its admission finds it restored):
        ``(node, depth)``, or None. `st.prefix.restore_blocked`: one was found and does not fit
        yet."""
        tier, st.prefix.restore_blocked = process().tier, False
        if tier is None or not st.cfg.host.offload:
            return None
        node = st.prefix.restored
        if (
            node is not None
            and node.parent is not None
            and history.view_of(node) is not None
            and node.parent.children.get(node.key.child_key(self.page_size)) is node
        ):
            depth = len(node.key) + len(node.vt.view.tail)
            if floor < depth <= limit:
                return node, depth
        st.prefix.restored = None
        ns = host_history.host_key(history.namespace(req, st), req.cache_salt)
        hit = host_history.find(tier, ns, logical, limit, floor)
        if hit is None or not host_history.restorable(hit[0].row.positions, hit[1], self.page_size):
            return None  # none, or cut where it kept nothing: never "does not fit yet"
        node = host_history.restore(self, req, st, *hit)
        st.prefix.restored, st.prefix.restore_blocked = node, node is None
        return None if node is None else (node, hit[1])

    def _plain(
        self, req: Req, st: ReqEvictState, result: MatchResult, key: RadixKey
    ) -> MatchResult:
        """A plain prefill's match (`_observed`); matched for its first chunk, it sets where the
        request's own prompt begins (`Prefix.matched`)."""
        result = self._observed(result, key, st)
        if not req.kv.holds_kv:
            st.prefix.matched = result.device_prefix_len
        return result

    def _observed(
        self, result: MatchResult, key: RadixKey, st: ReqEvictState | None
    ) -> MatchResult:
        """A plain prefix hit leaves the last `obs_window` prompt tokens to be prefilled again
        when the policy reads attention: their queries seed its statistics, so a request's
        victims (and output) do not depend on whether its prompt was cached. Under eviction
        during prefill a hit stops short of the prefill peak (by `obs_window` for attention
        policies, a page otherwise), so the first chunk runs and is evicted like an uncached one;
        under the pressure trigger it does not (a whole history is matched whole; a prompt that
        must still be evicted during prefill evicts after its first page, `prefill.chunk_limit`)."""
        if st is None:
            return result
        cap = len(key)
        attn = "attn" in st.policy.needs
        if attn:
            cap = min(cap, len(key.token_ids) - st.cfg.scoring.obs_window)
        if st.cfg.prefill_peak is not None and not st.cfg.on_pressure:
            cap = min(
                cap, st.cfg.prefill_peak - (st.cfg.scoring.obs_window if attn else st.cfg.page_size)
            )
        cap = max(0, cap)
        if result.device_prefix_len <= cap:
            return result
        return super().match_prefix(
            MatchPrefixParams(
                key=RadixKey(
                    key.token_ids,
                    key.extra_key,
                    is_bigram=key.is_bigram,
                    limit=cap,
                    cache_salt=key.cache_salt,
                )
            )
        )

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        st = state_of(req)
        hit = st.prefix.hit if st is not None else None
        if st is not None and hit is not None and req.last_node is hit.node:
            if not history_pages.own_tail(self, req, st):  # admission copied it (admission.py)
                raise RuntimeError("no free page for the copy of a stored view's last page")
            own = st.prefix.hit  # the view with the request's own last page (own_tail)
            assert own is not None
            return own.slots
        return super().prefix_device_indices(req)

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
