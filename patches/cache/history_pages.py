"""Compacted histories at page size > 1: a stored view owns whole pages, not per-position slots.

A node's key ends at the history's last whole page (holes only: value -1 throughout), the ids
past it are the view's tail, which a match must continue with, and the node owns the row's
private pages (`node.vt.pages`, kept on the host so the eviction step frees them without reading
the device); the view's other pages belong to its ancestors. The view's partial last page is
copied on write into a new request's own page at admission (`own_tail`). Sizes count owned slots
(`history.live`). Design: docs/design/cache.md, "Compacted histories at page size > 1".
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.radix_cache import RadixKey

from sgl_vtoken.kernels import repack_kv_

from . import history, pool

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req, TreeNode
    from ..core.state import ReqEvictState


def owned(node: TreeNode) -> torch.Tensor | None:
    """Slots of the whole pages `node` owns (page size > 1, host), or None (a per-position node)."""
    record = history.record_of(node)
    return None if record is None else record.pages


def insert(tree: RadixTree, req: Req, st: ReqEvictState, row_len: int) -> None:
    """Store the finished row `[0, row_len)` as a view: its private pages go to a new leaf. The
    row stays private when a view is stored at these positions already, or when its tree-owned
    pages are not on the new node's path."""
    ps = tree.page_size
    logical = st.prompt.logical_ids(req)
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :row_len].to(torch.int64)
    cpl = req.kv.cache_protected_len
    if cpl % ps:
        raise RuntimeError(f"a row's tree-owned prefix {cpl} is not page-aligned (page size {ps})")
    total = row_len + st.row.offset
    head = min(st.prefix.attach, total) // ps * ps
    head_key = RadixKey(logical[:head], req.extra_key, cache_salt=req.cache_salt)
    values, attach_node = (
        tree._match_prefix_helper(tree.root_node, head_key) if head else ([], tree.root_node)
    )
    attach = sum(len(v) for v in values)
    end = attach + (total - attach) // ps * ps
    if end == attach:
        return
    key = RadixKey(logical[attach:end], history.namespace(req, st), cache_salt=req.cache_salt)
    old, last = tree._match_prefix_helper(attach_node, key)
    if sum(len(v) for v in old) == len(key):
        return  # a view ends here already: keep the row private
    on_path, reachable, a = set(), [torch.cat(values)] if values else [], last
    while a is not attach_node:
        on_path.add(a)
        node_pages = owned(a)
        assert node_pages is not None, "a node of a view's path owns pages (page size > 1)"
        reachable.append(node_pages.to(row.device))
        a = a.parent
    reachable_pages = torch.cat(reachable) // ps if reachable else row[:0]
    missing = torch.unique(row[:cpl] // ps)
    missing = missing[~torch.isin(missing, reachable_pages)]
    if missing.numel() and not rehome(
        tree, st.prefix.hit.node if st.prefix.hit else None, on_path, missing
    ):
        return  # the row uses pages the new node's path does not hold
    pages = row[cpl:row_len:ps] // ps
    value = torch.full((len(key),), -1, dtype=torch.int64, device=row.device)
    view = history.StoredView(
        st.row.positions(row_len).to(row.device),
        row.clone(),
        attach,
        array("q", logical[end:total]),
    )
    _, node = history.insert_view(
        tree,
        attach_node,
        key,
        value,
        req.priority or 0,
        view,
        (pages[:, None] * ps + torch.arange(ps, device=row.device)).flatten().cpu(),
    )
    history.hand_over(tree, req, st, node, row_len)
    punch(tree, node)


def rehome(
    tree: RadixTree, view_node: TreeNode | None, on_path: set[TreeNode], pages: torch.Tensor
) -> bool:
    """The row continued a view cut short (`view_node`, on another branch) and keeps some of its
    `pages`: move each such page from the view's chain to the first of its ancestors on the new
    path (their common ancestor), which outlives both branches. Returns whether every page in
    `pages` now lies on the path."""
    ps, todo, node = tree.page_size, pages, view_node
    while todo.numel() and node is not None and owned(node) is not None and node not in on_path:
        home = node.parent
        while home is not None and home not in on_path:
            home = home.parent
        if home is None or owned(home) is None:
            return False
        mask = torch.isin(node.vt.pages // ps, todo.to(node.vt.pages.device))
        if bool(mask.any()):
            moved = node.vt.take(mask)
            home.vt.give(moved)
            n = int(moved.numel())
            if home.lock_ref and not node.lock_ref:  # evictable slots become protected ones
                tree.evictable_size_ -= n
                tree.protected_size_ += n
            todo = todo[~torch.isin(todo, moved.to(todo.device) // ps)]
        node = node.parent
    return not todo.numel()


def punch(tree: RadixTree, node: TreeNode) -> None:
    """Free the pages of `node`'s holed ancestors that its view does not use and that no other
    row or view can reach (a chain locked only by `node`'s holder)."""
    keep = torch.unique(node.vt.view.slots // tree.page_size).cpu()
    a = node.parent
    while owned(a) is not None and a.lock_ref == 1 and len(a.children) == 1:
        history.drop_view(a)
        free_unused(tree, a, keep)
        a = a.parent


def release_unused(tree: RadixTree, req: Req, kept_pages: torch.Tensor) -> int:
    """After an eviction of `req`'s row: free the pages of the stored view it continues, and of
    that view's chain, that only it can reach and that the row no longer uses; those views
    become unusable. `kept_pages` (host): the tree-owned pages the row still references (the
    chain's pages are never among its own or fresh pages). Host work only: no device read.
    Returns the pages freed."""
    node, freed = req.last_node, 0
    if owned(node) is None or node.lock_ref != 1 or node.children:
        return 0
    while owned(node) is not None and node.lock_ref == 1 and len(node.children) <= 1:
        history.drop_view(node)
        freed += free_unused(tree, node, kept_pages)
        node = node.parent
    return freed


def free_unused(tree: RadixTree, node: TreeNode, keep_pages: torch.Tensor) -> int:
    """Free the pages a locked node owns that are not in `keep_pages` (host page ids). Returns
    the pages freed."""
    ps, slots = tree.page_size, node.vt.pages
    drop = ~torch.isin(slots // ps, keep_pages)
    n = int(drop.sum())  # host tensors: no device read
    if n:
        pages = torch.unique(node.vt.take(drop) // ps)
        tree.token_to_kv_pool_allocator.free_page_ids(pages.to(tree.device, non_blocking=True))
        tree.protected_size_ -= n
    return n // ps


def own_tail(tree: RadixTree, req: Req, st: ReqEvictState) -> bool:
    """At admission (`admission.py`): a request continuing a view (`st.prefix.hit`) gets its own
    copy of the view's partial last page, so its prefill continues there (SGLang charges every
    admitted request a page for a partly filled last page: this is that page). False when no page
    is free (the request is not admitted this round)."""
    hit = st.prefix.hit
    if hit is None or hit.copied or tree.page_size == 1 or req.last_node is not hit.node:
        return True
    slots = copy_tail(tree, hit.slots, req)
    if slots is None:
        return False
    st.prefix.continue_from(hit.node, slots, st.prefix.attach, copied=True)
    return True


def copy_tail(tree: RadixTree, slots: torch.Tensor, req: Req | None = None) -> torch.Tensor | None:
    """The view `slots` as a new request's prefix: its partial last page copied into a fresh
    page (KV of every layer), so the request's prefill continues there. Returns the prefix, or
    None when no page is free (`pool.alloc`)."""
    ps = tree.page_size
    k = len(slots) % ps
    if k == 0:
        return slots
    fresh = pool.alloc(tree, ps, req, "tail")
    if fresh is None:
        return None
    kv = tree.token_to_kv_pool_allocator.get_kvcache()
    dst = fresh[:k].to(slots.device, torch.int64)
    repack_kv_(kv.k_buffer, kv.v_buffer, slots[-k:].to(torch.int64), dst)
    return torch.cat([slots[:-k], dst])
