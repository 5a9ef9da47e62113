"""Compacted histories in the holed radix cache: a finished evicting request leaves its row in
the tree with holes, a next turn that extends it continues from it, and the slots that nobody can
reach any more are freed early (docs/design/cache.md, "Prefix sharing under eviction"). This module
stores them per position (page size 1); `history_pages.py` stores them by whole pages (page
size > 1); matching and adopting a view are shared. A holed node carries a `NodeRecord` as
`node.vt` (hole-free nodes carry none), made when the holed cache inserts or splits it
(`insert_view`, `split`) and changed only here; the host store of its view is kept by the host
tier (`host_tier.HostTier.store_of`).

The functions take the `radix.HoledRadixCache` (`tree`) whose nodes and sizes they change; its
match (`prefix.match_prefix`), `checkpoint` and `release_dropped` call them.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from ..core.process import process

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req, TreeNode
    from ..core.state import ReqEvictState


class StoredView(NamedTuple):
    """The row a finished (or retracted) request left at a node: its entries' logical
    ``positions [m] int64`` (ascending) and their KV ``slots [m] int64`` (pool device); `attach`,
    the logical prefix below it whose KV is hole-free (full attention); `tail`, the logical ids
    it covers past the node's key (page size > 1; empty otherwise)."""

    positions: torch.Tensor
    slots: torch.Tensor
    attach: int
    tail: array


@dataclass(eq=False)
class NodeRecord:
    """`node.vt` of a holed radix node (its value is -1 where a token was evicted)."""

    live: int  # live slots: value >= 0, or the slots of `pages`
    pages: torch.Tensor | None = None  # page size > 1: slots of the whole pages it owns (host)
    view: StoredView | None = None  # the row that ended at this node
    host_ns: str | None = None  # its view moves to host memory when evicted, under this namespace

    def take(self, mask: torch.Tensor) -> torch.Tensor:
        """Page size > 1: the owned slots under `mask` (``[len(pages)] bool``) leave the node;
        returns them."""
        assert self.pages is not None, "a per-position node owns no pages"
        slots, self.pages = self.pages[mask], self.pages[~mask]
        self.live -= int(slots.numel())
        return slots

    def give(self, slots: torch.Tensor) -> None:
        """Page size > 1: the node owns `slots` (whole pages) too."""
        assert self.pages is not None, "a per-position node owns no pages"
        self.pages = torch.cat([self.pages, slots])
        self.live += int(slots.numel())


def offload_on_evict(node: TreeNode, ns: str | None) -> None:
    """The view at `node` moves to host memory under namespace `ns` when the tree evicts it
    (None: it is dropped with the node)."""
    node.vt.host_ns = ns


def record_of(node: TreeNode) -> NodeRecord | None:
    """The record of a holed radix node, or None (a hole-free node)."""
    return getattr(node, "vt", None)


def view_of(node: TreeNode) -> StoredView | None:
    """The view stored at `node`, or None."""
    record = record_of(node)
    return None if record is None else record.view


def live(node: TreeNode) -> int:
    """Live slots of `node` (all of its key unless it is holed)."""
    record = record_of(node)
    return len(node.key) if record is None else record.live


def _count(node: TreeNode) -> int:
    return int((node.value >= 0).sum())


def insert_view(
    tree: RadixTree,
    parent: TreeNode,
    key: RadixKey,
    value: torch.Tensor,
    priority: int,
    view: StoredView,
    pages: torch.Tensor | None = None,
) -> tuple[int, TreeNode]:
    """Insert the holed `key` below `parent` (`value`: a slot per position, -1 a hole) and
    store `view` at the node where it ends. A new node gets its record and counts only its live
    slots (the slots of its `pages` at page size > 1). Returns ``(matched, node)`` as
    `_insert_helper`."""
    matched, node = tree._insert_helper(parent, key, value, priority)
    if matched < len(key):  # a new holed node: the stock insert counted all of its key
        node.vt = NodeRecord(_count(node) if pages is None else int(pages.numel()), pages)
        tree.evictable_size_ -= len(node.key) - node.vt.live
    node.vt.view = view
    return matched, node


def insert_row(
    tree: RadixTree,
    slots: torch.Tensor,
    ids: array,
    positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ns: str,
    salt: str | None = None,
    non_blocking: bool = False,
) -> TreeNode:
    """A row put back into the tree: the K/V (host, ``[layers, n, H, D]``) of its entries at
    logical `positions` (``[n]``, ascending) written into the fresh `slots` (`pool.alloc`, whole
    pages: the first n take the entries), and a holed leaf under the root, in a namespace of its
    own (`ns` and a serial, with `salt`), keyed by `ids` (its logical ids, whole pages of them at
    page size > 1, the rest its view's tail) and holding the row as its view. A host history
    restored (`host_history.restore`) and a retracted row resumed (`retraction.resume`) both
    come back this way."""
    kv, ps, n = tree.token_to_kv_pool_allocator.get_kvcache(), tree.page_size, positions.numel()
    slots = slots.to(torch.int64)
    index = slots[:n]
    for layer in range(kv.layer_num):
        k, v = kv.get_key_buffer(layer), kv.get_value_buffer(layer)
        k[index] = keys[layer].to(k.device, k.dtype, non_blocking=non_blocking)
        v[index] = values[layer].to(v.device, v.dtype, non_blocking=non_blocking)
    tree._vt_serial = getattr(tree, "_vt_serial", 0) + 1  # a namespace nothing else uses
    end = len(ids) // ps * ps
    positions = positions.to(slots.device)
    value = torch.full((end,), -1, dtype=torch.int64, device=slots.device)
    if ps == 1:
        value[positions] = index
    view = StoredView(positions, index, 0, array("q", ids[end:]))
    key = RadixKey(ids[:end], f"{ns}#{tree._vt_serial}", cache_salt=salt)
    matched, node = insert_view(
        tree, tree.root_node, key, value, 0, view, None if ps == 1 else slots.cpu()
    )
    assert matched == 0, "a fresh namespace cannot match"
    return node


def split(new_node: TreeNode, child: TreeNode) -> None:
    """SGLang split `child`, `new_node` taking the front of its key: if `child` is holed,
    `new_node` is too. Its pages stay with `child` (the view's node); per-position nodes recount."""
    record = record_of(child)
    if record is None:
        return
    if record.pages is not None:
        new_node.vt = NodeRecord(0, record.pages[:0])
    else:
        new_node.vt = NodeRecord(_count(new_node))
        record.live = _count(child)


def namespace(req: Req, st: ReqEvictState) -> str:
    """Radix namespace of `req`'s stored histories: its own extra key and eviction settings."""
    return f"{req.extra_key or ''}|{st.cfg.history_namespace()}"


def find_view(
    tree: RadixTree, last: TreeNode | None, logical: array, limit: int, ns: str
) -> tuple[TreeNode, int] | None:
    """Where `logical[:limit]` continues a stored history: ``(node, depth)`` of a view and the
    logical tokens of it to reuse, or None.

    The deepest view that `logical[:limit]` extends whole (its key, then its tail) reuses all of
    it. Where `logical` leaves a stored history before one (its ids re-tokenized differently, an
    edited message), at the first differing id p inside a node's key or a view's tail, a view
    through that point is cut there (depth p: its entries at positions < p), when that reaches
    deeper: a kept token's KV depends only on the ids before it, never on later ones. A prompt
    that merely ends inside a stored history (a regenerated reply) is no cut: it is served as a
    fresh prompt, so its output does not depend on what was cached."""
    chain = []
    while last is not None:
        chain.append(last)
        last = last.parent
    best, cut, depth = None, None, 0
    for node in reversed(chain):
        depth += len(node.key) if node is not tree.root_node else 0
        if depth >= limit:
            break
        key = RadixKey(logical[depth:limit], ns)
        now = time.monotonic()
        d = depth
        while len(key) >= tree.page_size:
            child = node.children.get(key.child_key(tree.page_size))
            if child is None:
                break
            m = child.key.match(key)
            if m < len(child.key):
                if m and d + m < limit and (cut is None or d + m > cut[1]):
                    cut = (
                        child,
                        d + m,
                    )  # a differing id (not the end of the prompt) inside the key
                break
            child.last_access_time = now
            d, key, node = d + len(child.key), key[len(child.key) :], child
            if view_of(node) is None:
                continue
            tail = node.vt.view.tail
            n = _common(logical[d:limit], tail)
            if n == len(tail) and (best is None or d + n > best[1]):
                best = (node, d + n)
            elif n < len(tail) and n and d + n < limit and (cut is None or d + n > cut[1]):
                cut = (node, d + n)
    if cut is not None and (best is None or cut[1] > best[1]):
        view = _any_view(cut[0])
        return None if view is None else (view, cut[1])
    return best


def _common(a: array, b: array) -> int:
    """Length of the common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _any_view(node: TreeNode) -> TreeNode | None:
    """`node` if it holds a view, else the most recently used view below it, or None."""
    best, stack = None, [node]
    while stack:
        n = stack.pop()
        if view_of(n) is not None:
            if n is node:
                return n
            if best is None or n.last_access_time > best.last_access_time:
                best = n
        stack.extend(n.children.values())
    return best


def cut_view(node: TreeNode, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of `node`'s view at logical positions < `depth`: ``(positions, slots)``, a
    prefix of its row."""
    positions, slots = node.vt.view.positions, node.vt.view.slots
    n = int((positions < depth).sum())
    return (positions, slots) if n == len(positions) else (positions[:n], slots[:n])


def insert_history(tree: RadixTree, req: Req, st: ReqEvictState, row_len: int) -> None:
    """Insert the finished row `[0, row_len)` with holes; the tree then owns all of it. The row
    stays private if the tree holds other KV, or holes, at its positions."""
    logical = st.prompt.logical_ids(req)
    slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :row_len].to(torch.int64)
    positions = st.row.positions(row_len).to(slots.device)
    total = row_len + st.row.offset
    head_key = RadixKey(
        logical[: min(st.prefix.attach, total)], req.extra_key, cache_salt=req.cache_salt
    )
    values, attach_node = (
        tree._match_prefix_helper(tree.root_node, head_key)
        if len(head_key)
        else ([], tree.root_node)
    )
    attach = sum(len(v) for v in values)
    if attach >= total:
        return
    path = torch.cat(values) if values else slots[:0]
    head = positions < attach
    ok = bool((path[positions[head]] == slots[head]).all())
    key = RadixKey(logical[attach:total], namespace(req, st), cache_salt=req.cache_salt)
    old, _ = tree._match_prefix_helper(attach_node, key)
    known = torch.cat(old) if old else slots[:0]
    mid = ~head & (positions < attach + known.numel())
    ok = ok and bool((known[positions[mid] - attach] == slots[mid]).all())
    if not ok:
        return  # another row's KV or holes at these positions: keep the row private
    value = torch.full((total - attach,), -1, dtype=torch.int64, device=slots.device)
    value[positions[~head] - attach] = slots[~head]
    _, node = insert_view(
        tree,
        attach_node,
        key,
        value,
        req.priority or 0,
        StoredView(positions.clone(), slots.clone(), attach, array("q")),
    )
    hand_over(tree, req, st, node, row_len)
    punch(tree, node)


def hand_over(tree: RadixTree, req: Req, st: ReqEvictState, node: TreeNode, row_len: int) -> None:
    """The finished row `[0, row_len)` is now the stored view at `node` (any page size): the
    evicted tokens' host store goes with the view, the request's lock moves to `node`, and the
    tree owns the whole row."""
    if (tier := process().tier) is not None:
        tier.store(node, st)
        node.vt.host_ns = namespace(req, st) if st.cfg.host.offload else None
    tree.unlock(req.lock)
    req.lock = tree.lock(node)
    req.last_node = node
    req.kv.cache_protected_len = row_len


def release_dropped(tree: RadixTree, req: Req, dropped: torch.Tensor) -> int:
    """Free the slots at the logical positions `dropped` (host int64: tree-owned entries `req`'s
    eviction dropped from its row, so live ones: no device read) that lie in holed nodes only its
    row can reach (its stored view, not continued by anyone, and that view's chain, locked only by
    it); their views become unusable. Returns the number of slots freed."""
    node, freed = req.last_node, 0
    if record_of(node) is None or node.lock_ref != 1 or node.children:
        return 0
    end, a = 0, node
    while a is not tree.root_node:
        end, a = end + len(a.key), a.parent
    while record_of(node) is not None and node.lock_ref == 1 and len(node.children) <= 1:
        start = end - len(node.key)
        drop_view(node)
        here = dropped[(dropped >= start) & (dropped < end)] - start
        freed += free_where(tree, node, here.to(node.value.device, non_blocking=True), len(here))
        node, end = node.parent, start
    return freed


def drop_view(node: TreeNode) -> None:
    """The view of holed `node` becomes unusable; its host store (`host_tier.py`) is released."""
    node.vt.view = None
    if (tier := process().tier) is not None:
        tier.detach(node)


def free_where(tree: RadixTree, node: TreeNode, where: torch.Tensor, n: int | None = None) -> int:
    """Free live slots of a locked holed node (they become holes): those under the mask `where`,
    or, with `n`, the `n` live entries at the indices `where` (no device read). Returns `n`."""
    if n is None:
        where = where & (node.value >= 0)
        n = int(where.sum())
    if n:
        tree.token_to_kv_pool_allocator.free(node.value[where])
        node.value[where] = -1
        node.vt.live -= n
        tree.protected_size_ -= n
    return n


def punch(tree: RadixTree, node: TreeNode) -> None:
    """Free the live slots of `node`'s holed ancestors that its view does not use and that no
    other row or view can reach (a chain locked only by `node`'s holder)."""
    keep = node.vt.view.slots
    a = node.parent
    while record_of(a) is not None and a.lock_ref == 1 and len(a.children) == 1:
        drop_view(a)
        free_where(tree, a, ~torch.isin(a.value, keep))
        a = a.parent


def restore(req: Req, st: ReqEvictState) -> array:
    """Undo a previous round's match: logical ids back in the request; returns them."""
    st.retract.restore_outputs(req)
    if not st.restore_prompt(req):
        req.refresh_fill_ids()
    return req.full_untruncated_fill_ids


def adopt(req: Req, st: ReqEvictState, logical: array, positions: torch.Tensor, depth: int) -> None:
    """Continue from a stored view: the request's ids become the view's ids + the new ids (row
    coordinates), its positions those of the view, then `depth` onwards; the report says how
    much of its history it continues (`history_tokens`, `history_view_tokens`)."""
    view_ids = array("q", (logical[p] for p in positions.tolist()))
    st.prompt.adopt(req, view_ids + logical[depth:])
    req.refresh_fill_ids()
    st.report.continue_history(depth, len(positions))
    st.row.start_at(positions, depth)
