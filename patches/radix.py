"""Radix cache with holes: evicting requests share their prompts, drop shared tokens from their
own view, and leave their compacted history in the tree when they finish, so that a next turn
extending that history continues from it (history: page size 1).

Registered as `--radix-cache-backend vtoken` (chosen automatically with `--kv-evict`). It is
SGLang's Python `RadixCache` plus:

    key     the full logical token ids (evicted tokens' ids stay: kept tokens' KV depends on them)
    value   one slot per logical position, -1 where the token was evicted (a hole)
    space   hole-free prefix (shared by everyone) -> holed suffix under the namespace
            `extra_key|EvictConfig.history_namespace()` (other settings never see it)
    view    the node where a history ends records the finishing row: (positions, slots)

    turn 1  | system prompt (hole-free) | user . . reply . . |      "." evicted, -1 in the value
    turn 2  matches the turn-1 view: row = view slots, prefill = the new tokens only,
            RoPE offset = logical length - view length; evicting drops old tokens from the view

Sizes count live slots, so SGLang's pool checkers hold. Slots nobody else can reach are freed
as soon as possible: those a running turn drops from the view it continued (`release_dropped`),
and, when a history is stored, the older ancestors' slots its view no longer uses (`_punch`).
Only requests under eviction at page size 1 take the holed paths (`reuse_history: false` keeps
prompt sharing and stores no history); every other request is served exactly as by `RadixCache`.
"""

from __future__ import annotations

import heapq
import time
from array import array

import torch
from sglang.srt.mem_cache.base_prefix_cache import (DecLockRefResult, EvictResult,
                                                     IncLockRefResult, MatchPrefixParams,
                                                     MatchResult)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

NAME = "vtoken"
_active = False  # this process serves from a HoledRadixCache


def tree_mode(cfg) -> bool:
    """Whether a request under `cfg` is served by this cache's paths: its prompt is shared,
    tree-owned tokens may leave its row, and (page size 1, `reuse_history`) its history is
    stored. Naive-Evict takes them too (same caching, same victims; only its footprint differs)."""
    return _active and cfg.enabled


def factory(ctx):
    """`register_radix_cache_backend` factory."""
    global _active
    for bad, why in ((ctx.disable_radix_cache, "--disable-radix-cache"),
                     (ctx.is_hybrid_swa or ctx.is_hybrid_ssm, "hybrid SWA / Mamba models"),
                     (ctx.enable_hierarchical_cache, "--enable-hierarchical-cache")):
        if bad:
            raise ValueError(f"--radix-cache-backend {NAME} cannot run with {why}")
    _active = True
    return HoledRadixCache(ctx.params)


def _live(node) -> int:
    live = getattr(node, "vt_live", None)
    return len(node.key) if live is None else live


def _count_live(node) -> int:
    """Mark `node` holed and (re)count its live slots."""
    node.vt_live = int((node.value >= 0).sum())
    return node.vt_live


def _namespace(req, st) -> str:
    return f"{req.extra_key or ''}|{st.cfg.history_namespace()}"


class HoledRadixCache(RadixCache):
    """`RadixCache` whose holed nodes (attribute `vt_live`) count only live slots."""

    vt_counters = None  # the scheduler's VTokenCounters (history hits), set at scheduler start

    # --- sizes count live slots -----------------------------------------------------------------
    def inc_lock_ref(self, node) -> IncLockRefResult:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 0:
                n = _live(node)
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node, params=None) -> DecLockRefResult:
        delta = 0
        while node != self.root_node:
            if node.lock_ref == 1:
                n = _live(node)
                self.evictable_size_ += n
                self.protected_size_ -= n
                delta += n
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return DecLockRefResult(delta=delta)

    def _split_node(self, key, child, split_len):
        new_node = super()._split_node(key, child, split_len)
        if getattr(child, "vt_live", None) is not None:
            _count_live(new_node)
            _count_live(child)
        return new_node

    def _delete_leaf(self, node):
        super()._delete_leaf(node)
        self.evictable_size_ += len(node.key) - _live(node)

    def evict(self, params) -> EvictResult:
        start = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, x = heapq.heappop(heap)
            if getattr(x, "vt_live", None) is None:  # hole-free: page-exact segment, as stock
                self.token_to_kv_pool_allocator.free_segment(x.value, start_pos=0)
                evicted += len(x.value)
            else:
                live = x.value[x.value >= 0]
                self.token_to_kv_pool_allocator.free(live)
                evicted += int(live.numel())
            self._delete_leaf(x)
            if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
            self.kv_events.record_remove(x)
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    def total_size(self):
        return int(self.all_values_flatten().numel())

    def all_values_flatten(self):
        values = super().all_values_flatten()
        return values[values >= 0]

    # --- matching -------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        st = getattr(req, "vtoken", None) if req is not None else None
        if st is None or not st.holed:
            return super().match_prefix(params)
        logical = _restore(req, st)
        limit = req._compute_max_prefix_len(len(logical))
        result = super().match_prefix(MatchPrefixParams(
            key=RadixKey(logical, req.extra_key, cache_salt=req.cache_salt, limit=limit)))
        st.attach = len(logical)
        if st.stash is not None:  # retracted after evicting: resume from its row (retraction.py)
            return self._resume(req, st, logical, limit, result)
        if (not st.cfg.reuse_history or self.page_size > 1 or req.output_ids
                or (req.return_logprob and req.logprob_start_len >= 0)):
            return result  # retracted (re-prefilled whole) or asks for input logprobs
        found = self._find_view(result.last_device_node, logical, limit, _namespace(req, st))
        if found is None or found[1] <= result.device_prefix_len:
            return result
        node, depth = found
        positions, slots = node.vt_view
        _adopt(req, st, logical, positions, depth)
        st.hit, st.attach = (node, slots), node.vt_attach
        return MatchResult(device_prefix_len=len(positions), last_device_node=node,
                           last_host_node=node, best_match_node=node)

    def _resume(self, req, st, logical: array, limit: int, result: MatchResult) -> MatchResult:
        """Match a retracted request to its stashed row, written back into the tree if the tree
        no longer holds it (or `st.blocked` and the plain match when the pool cannot hold it)."""
        stash, node = st.stash, st.resume_node
        if stash.depth > limit:
            raise RuntimeError(f"retracted row covers {stash.depth} tokens, the match is capped at {limit}")
        if node is None or node.parent is None or getattr(node, "vt_view", None) is None or \
                node.parent.children.get(node.key.child_key(self.page_size)) is not node:
            node = st.resume_node = self._insert_stash(stash)
        st.blocked = node is None
        if node is None:
            return result
        positions, slots = node.vt_view
        _adopt_retracted(req, st, logical, positions, stash.depth)
        st.hit, st.attach = (node, slots), 0
        return MatchResult(device_prefix_len=len(positions), last_device_node=node,
                           last_host_node=node, best_match_node=node)

    def _insert_stash(self, stash):
        """A holed leaf under the root holding the stash's row in fresh slots, or None."""
        from .retraction import write_back

        slots = write_back(self, stash)
        if slots is None:
            return None
        self._vt_serial = getattr(self, "_vt_serial", 0) + 1  # a namespace nothing else uses
        key = RadixKey(stash.ids, f"{stash.namespace}#{self._vt_serial}")
        positions = stash.positions.to(slots.device)
        value = torch.full((stash.depth,), -1, dtype=torch.int64, device=slots.device)
        value[positions] = slots
        matched, node = self._insert_helper(self.root_node, key, value, 0)
        assert matched == 0, "a fresh namespace cannot match"
        self.evictable_size_ -= len(node.key) - _count_live(node)
        node.vt_view, node.vt_attach = (positions, slots), 0
        return node

    def prefix_device_indices(self, req) -> torch.Tensor:
        hit = getattr(getattr(req, "vtoken", None), "hit", None)
        if hit is not None and req.last_node is hit[0]:
            return hit[1]
        return super().prefix_device_indices(req)

    def _find_view(self, last, logical: array, limit: int, ns: str):
        """(node, logical depth) of the deepest stored view that `logical[:limit]` extends."""
        chain = []
        while last is not None:
            chain.append(last)
            last = last.parent
        best, depth = None, 0
        for node in reversed(chain):
            depth += len(node.key) if node is not self.root_node else 0
            if depth >= limit:
                break
            key = RadixKey(logical[depth:limit], ns)
            now = time.monotonic()
            d = depth
            while len(key):
                child = node.children.get(key.child_key(self.page_size))
                if child is None or child.key.match(key) < len(child.key):
                    break
                child.last_access_time = now
                d, key, node = d + len(child.key), key[len(child.key):], child
                if getattr(node, "vt_view", None) is not None and (best is None or d > best[1]):
                    best = (node, d)
        return best

    # --- inserting ------------------------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int):
        st = getattr(req, "vtoken", None)
        if st is None or not st.holed:
            return super().checkpoint(req, up_to=up_to)
        if st.steps == 0 and st.hit is None:
            return super().checkpoint(req, up_to=up_to)  # contiguous, full attention: stock
        if req.finished() and st.cfg.reuse_history and self.page_size == 1:
            if st.resume_node is None:  # a resumed row lives in a namespace of its own: keep it private
                self._insert_history(req, st, up_to)
            counters = self.vt_counters
            if "history_tokens" in st.report and counters is not None:
                counters.history_hits += 1
                counters.history_tokens_reused += st.report["history_tokens"]

    def _insert_history(self, req, st, row_len: int) -> None:
        """Insert the finished row `[0, row_len)` with holes; the tree then owns all of it."""
        logical = st.logical_ids(req)
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :row_len].to(torch.int64)
        positions = st.positions(row_len).to(slots.device)
        total = row_len + st.offset
        head_key = RadixKey(logical[:min(st.attach, total)], req.extra_key, cache_salt=req.cache_salt)
        values, attach_node = (self._match_prefix_helper(self.root_node, head_key) if len(head_key)
                               else ([], self.root_node))
        attach = sum(len(v) for v in values)
        if attach >= total:
            return
        path = torch.cat(values) if values else slots[:0]
        head = positions < attach
        ok = bool((path[positions[head]] == slots[head]).all())
        key = RadixKey(logical[attach:total], _namespace(req, st), cache_salt=req.cache_salt)
        old, _ = self._match_prefix_helper(attach_node, key)
        known = torch.cat(old) if old else slots[:0]
        mid = ~head & (positions < attach + known.numel())
        ok = ok and bool((known[positions[mid] - attach] == slots[mid]).all())
        if not ok:
            return  # another row's KV or holes at these positions: keep the row private
        value = torch.full((total - attach,), -1, dtype=torch.int64, device=slots.device)
        value[positions[~head] - attach] = slots[~head]
        matched, node = self._insert_helper(attach_node, key, value, req.priority or 0)
        if matched < len(key):  # a new holed node: the stock insert counted all of its key
            self.evictable_size_ -= len(node.key) - _count_live(node)
        node.vt_view, node.vt_attach = (positions.clone(), slots.clone()), attach
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node
        req.kv.cache_protected_len = row_len
        self._punch(node)

    def release_dropped(self, req, dropped: torch.Tensor) -> int:
        """Free the slots `req`'s eviction dropped from its row that lie in holed nodes only its
        row can reach (its stored view, not continued by anyone, and that view's chain, locked
        only by it); their views become unusable. Returns the number of slots freed."""
        node, freed = req.last_node, 0
        if getattr(node, "vt_live", None) is None or node.lock_ref != 1 or node.children:
            return 0
        while getattr(node, "vt_live", None) is not None and node.lock_ref == 1 and len(node.children) <= 1:
            node.vt_view = None
            freed += self._free_where(node, torch.isin(node.value, dropped))
            node = node.parent
        return freed

    def relock_shallower(self, req, need: int) -> None:
        """Move `req`'s lock on a hole-free path up to the shallowest node that still covers the
        first `need` tokens of the path, splitting at a page boundary: the deeper part of the
        prompt then belongs to whoever else holds it, or becomes evictable."""
        node = req.last_node
        if node is None or node is self.root_node or getattr(node, "vt_live", None) is not None:
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

    def _free_where(self, node, mask: torch.Tensor) -> int:
        """Free the live slots of a locked holed node under `mask` (they become holes)."""
        mask = mask & (node.value >= 0)
        n = int(mask.sum())
        if n:
            self.token_to_kv_pool_allocator.free(node.value[mask])
            node.value[mask] = -1
            node.vt_live -= n
            self.protected_size_ -= n
        return n

    def _punch(self, node) -> None:
        """Free the live slots of `node`'s holed ancestors that its view does not use and that no
        other row or view can reach (a chain locked only by `node`'s holder)."""
        keep = node.vt_view[1]
        a = node.parent
        while getattr(a, "vt_live", None) is not None and a.lock_ref == 1 and len(a.children) == 1:
            a.vt_view = None
            self._free_where(a, ~torch.isin(a.value, keep))
            a = a.parent


def _restore(req, st) -> array:
    """Undo a previous round's match: logical ids back in the request; returns them."""
    restore_outputs(req, st)
    if st.logical_prompt is not None:
        req.origin_input_ids = st.logical_prompt
        st.logical_prompt, st.hit = None, None
        st.kept_pos, st.offset = st.kept_pos[:0], 0
    req.refresh_fill_ids()
    return req.full_untruncated_fill_ids


def _adopt_retracted(req, st, logical: array, positions: torch.Tensor, depth: int) -> None:
    """Resume a retracted request from its view. SGLang prefills `origin + output` past the
    prefix, but the view may hold fewer entries than the request has outputs (outputs evicted
    too). Until its prefill is prepared the request is therefore split at the view instead:
    origin = the view's prompt entries, output = the view's output entries + the ids past
    `depth` (the last output); `restore_outputs` puts the real outputs back."""
    outputs = req.output_ids
    prompt_len = len(logical) - len(outputs)
    pos = positions.tolist()
    st.logical_prompt, st.real_outputs = req.origin_input_ids, outputs
    req.origin_input_ids = array("q", (logical[p] for p in pos if p < prompt_len))
    req.output_ids = array("q", (logical[p] for p in pos if p >= prompt_len)) + logical[depth:]
    req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
    st.kept_pos, st.offset = positions.clone().cpu(), depth - len(positions)


def restore_outputs(req, st) -> None:
    """Give a resumed request its real outputs back (after its prefill is prepared, or when it
    was not admitted); its prompt stays in row coordinates."""
    if st.real_outputs is not None:
        req.output_ids, st.real_outputs = st.real_outputs, None
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids


def _adopt(req, st, logical: array, positions: torch.Tensor, depth: int, report: bool = True) -> None:
    """Continue from a stored view: the request's ids become the view's ids + the new ids (row
    coordinates), its positions those of the view, then `depth` onwards."""
    st.logical_prompt = req.origin_input_ids
    req.origin_input_ids = array("q", (logical[p] for p in positions.tolist())) + logical[depth:]
    req.refresh_fill_ids()
    st.kept_pos, st.offset = positions.clone().cpu(), depth - len(positions)
    if report:
        st.report.update(history_tokens=depth, history_view_tokens=len(positions))
