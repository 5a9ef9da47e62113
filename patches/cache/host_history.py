"""Host histories: a stored compacted history that the radix cache evicts for room moves to host
memory, and the next turn that extends it gets it back into fresh device slots instead of
prefilling its whole conversation again (docs/design/cache.md, "Host histories").

    tree LRU evicts a view's leaf ──offload_view──> HostHistory (ids, positions, K/V, store)
    a turn extends it: match_prefix ──find──> restore ──> a holed leaf of its own namespace
    that turn finishes ──store_row──> HostHistory again (its row never joins the shared tree)

A restored row lives under the root in a namespace of its own, like a resumed retraction, so it
never meets another row's slots; its finished turn goes back to host memory directly, and a
turn continued from a resumed retraction does too. Only views stored by requests with `offload`
on move (`NodeRecord.host_ns`), and only such requests restore; the host tier's `host_tokens`
caps host histories together with the evicted tokens' stores, least recently used first.
"""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING

import torch

from ..core.process import process
from ..core.records import Chunk
from . import history, pool
from .host_tier import HostHistory, HostTier, to_host

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req, TreeNode
    from ..core.state import ReqEvictState


def host_key(ns: str, cache_salt: str | None) -> str:
    """The key host histories are filed under: the radix namespace of the request's histories and
    its `cache_salt` (requests of different salts never share KV)."""
    return ns if cache_salt is None else f"{ns}|salt:{cache_salt}"


def _gather(
    tree: RadixTree, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """K and V of `slots` (every layer) copied to the host: ``[n, layers, H, D]`` each, and the
    event after which they hold the values (`to_host`)."""
    kv = tree.token_to_kv_pool_allocator.get_kvcache()
    index = slots.to(tree.token_to_kv_pool_allocator.device, torch.int64)
    layers = range(kv.layer_num)
    k, _ = to_host(torch.stack([kv.get_key_buffer(i)[index] for i in layers], dim=1))
    v, ready = to_host(torch.stack([kv.get_value_buffer(i)[index] for i in layers], dim=1))
    return k, v, ready


def _keep(
    tier: HostTier,
    tree: RadixTree,
    ns: str,
    ids: array,
    positions: torch.Tensor,
    slots: torch.Tensor,
    store: list[Chunk],
    used: float,
) -> bool:
    """A host history of the entries at logical `positions` (KV at device `slots`) covering
    `ids`, with the recall `store` (chunks the caller owns), if the cap makes room for it among
    what was used before `used`. Returns whether it was kept (if not, `store` is released)."""
    n = int(positions.numel())
    if tier.make_room(n, before=used) < n:
        tier.drop(store)
        tier.histories_dropped += 1
        return False
    k, v, ready = _gather(tree, slots)
    row = Chunk(positions.cpu().clone(), k, v, ready=ready)
    tier.hold([row])
    tier.keep(HostHistory(ns, torch.tensor(ids, dtype=torch.int64), row, store, used))
    return True


def offload_view(tree: RadixTree, node: TreeNode) -> None:
    """BEFORE the radix cache frees the evicted leaf `node`: its view, if stored with offload on,
    moves to host memory with its store (its ancestors still hold the view's other slots)."""
    tier, record = process().tier, history.record_of(node)
    if tier is None or record is None or record.view is None or record.host_ns is None:
        return
    parts, a = [], node
    while a is not tree.root_node:
        parts.append(a.key.token_ids)
        a = a.parent
    ids = array("q")
    for part in reversed(parts):
        ids.extend(part)
    ids.extend(record.view.tail)
    view, store = record.view, tier.take_store(node)
    ns = host_key(record.host_ns, node.key.cache_salt)
    _keep(tier, tree, ns, ids, view.positions, view.slots, store, node.last_access_time)


def find(
    tier: HostTier, ns: str, logical: array, limit: int, floor: int
) -> tuple[HostHistory, int] | None:
    """The host history of namespace `ns` that `logical[:limit]` continues deepest, past depth
    `floor`: ``(history, depth)``, or None. As `history.find_view`: a history the prompt extends
    whole is reused whole; one it leaves at a differing id is cut there; one the prompt merely
    ends inside (a regenerated reply) is not used."""
    if limit <= floor or not tier.histories:
        return None
    prompt = torch.tensor(logical[:limit], dtype=torch.int64)
    best = None
    for h in tier.histories.values():
        n = min(h.depth, limit)
        if h.ns != ns or n <= floor:
            continue
        differ = (h.ids[:n] != prompt[:n]).nonzero()
        common = n if not differ.numel() else int(differ[0])
        if common == n and n < h.depth:
            continue  # the prompt ends inside it
        if common > floor and (best is None or common > best[1]):
            best = (h, common)
    return best


def restorable(positions: torch.Tensor, depth: int, page_size: int) -> bool:
    """Whether a host history whose kept entries sit at `positions` can be restored to `depth`:
    at least a page deep, with an entry below it (a history cut where it kept nothing, e.g.
    another conversation's shared opening past its sinks, is no history to continue)."""
    return depth >= page_size and bool((positions < depth).any())


def restore(
    tree: RadixTree, req: Req, st: ReqEvictState, h: HostHistory, depth: int
) -> TreeNode | None:
    """Write `h`'s entries at positions < `depth` into fresh slots (whole pages at page size > 1)
    as a holed leaf under the root in a namespace of its own, which takes `h`'s store; `h` leaves
    host memory. Returns the node, or None when the pool cannot give the slots now (`h` stays).
    The history must be `restorable` to `depth`."""
    tier, ps = process().tier, tree.page_size
    ns, salt = history.namespace(req, st), req.cache_salt
    assert tier is not None, "host histories live in the host tier"
    assert restorable(h.row.positions, depth, ps), "restore() of an unrestorable history"
    n = int((h.row.positions < depth).sum())  # positions ascend: the entries are a prefix
    slots = pool.alloc(tree, -(-n // ps) * ps, req, "restore")
    if slots is None:
        return None
    h.row.wait()
    ids = array("q", h.ids[:depth].tolist())
    keys, values = h.row.k[:n].transpose(0, 1), h.row.v[:n].transpose(0, 1)
    node = history.insert_row(
        tree, slots, ids, h.row.positions[:n], keys, values, f"{h.ns}|host", salt, True
    )
    history.offload_on_evict(node, ns)  # evicted before its turn runs: back to host memory
    node.last_access_time = time.monotonic()
    store, h.store = h.store, []
    tier.give_store(node, store)
    tier.release(h)
    tier.histories_restored += 1
    tier.bytes_to_device += h.row.nbytes
    return node


def store_row(tree: RadixTree, req: Req, st: ReqEvictState, row_len: int) -> None:
    """A finished turn whose row started from a restored history (or a resumed retraction): the
    row `[0, row_len)` goes to host memory as its conversation's history, with its recall store;
    the node it started from keeps no view. Nothing happens without offload."""
    tier = process().tier
    start = st.prefix.restored or st.retract.resume_node
    if start is not None and history.view_of(start) is not None:
        history.drop_view(start)
    if tier is None or not st.cfg.host.offload:
        return
    ids = st.prompt.logical_ids(req)[: row_len + st.row.offset]
    slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :row_len]
    store = st.host.take()
    st.report.hold_host(sum(c.nbytes for c in store))
    ns = host_key(history.namespace(req, st), req.cache_salt)
    _keep(tier, tree, ns, ids, st.row.positions(row_len), slots, store, time.monotonic())
