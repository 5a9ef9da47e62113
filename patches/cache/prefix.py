"""What a request's row starts from in the holed radix cache: its match (`match_prefix`, called
by `radix.HoledRadixCache.match_prefix`) and the result it keeps, `Prefix` (`st.prefix`).

A request outside the holed paths is matched as by `RadixCache`; an evicting one on its logical
ids: a retracted row resumes from its stash, a turn that extends a stored history continues from
its view, found on the device tree (`history.find_view`) or restored from host memory
(`host_history.py`), any other is a plain prefill. A plain hit of a request with eviction settings
stops short where its prompt must still be computed (`_observed`). Design: docs/design/cache.md,
"Prefix sharing under eviction".
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from ..core.process import process
from ..core.state import state_of
from . import history, history_pages, host_history

if TYPE_CHECKING:
    from ..core.sglang_types import RadixTree, Req, TreeNode
    from ..core.state import ReqEvictState


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


def match_prefix(tree: RadixTree, params: MatchPrefixParams) -> MatchResult:
    """`HoledRadixCache.match_prefix`: `RadixCache`'s match for a request that does not evict,
    else the match of its logical ids, its row's start recorded in `st.prefix`."""
    req = params.req
    st = state_of(req) if req is not None else None
    if st is None or not st.holed:
        return _observed(tree, RadixCache.match_prefix(tree, params), params.key, st)
    logical = history.restore(req, st)
    limit = req._compute_max_prefix_len(len(logical))
    key = RadixKey(logical, req.extra_key, cache_salt=req.cache_salt, limit=limit)
    result = RadixCache.match_prefix(tree, MatchPrefixParams(key=key))
    st.prefix.continue_from(None, None, len(logical))  # no view yet: a plain prefill
    if not req.kv.holds_kv:
        st.prefix.matched = None
    st.prefix.restore_blocked = False
    if st.retract.stash is not None:  # retracted after evicting: resume from its row
        return st.retract.resume(tree, req, st, logical, limit, result)
    if (
        not st.cfg.history.reuse
        or req.output_ids
        or (req.return_logprob and req.logprob_start_len >= 0)
    ):
        return _plain(tree, req, st, result, key)  # retracted (re-prefilled whole) or logprobs
    found = history.find_view(
        tree, result.last_device_node, logical, limit, history.namespace(req, st)
    )
    floor = max(result.device_prefix_len, found[1] if found is not None else 0)
    restored = _from_host(tree, req, st, logical, limit, floor)
    if st.prefix.restore_blocked:  # the pool may have evicted nodes of `result` meanwhile
        result = RadixCache.match_prefix(tree, MatchPrefixParams(key=key))
    if restored is not None:
        found = restored
    if found is None or found[1] <= result.device_prefix_len:
        st.report.history_from("none")
        return _plain(tree, req, st, result, key)
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
        cache_protected_len=len(positions) // tree.page_size * tree.page_size,
    )


def _from_host(
    tree: RadixTree, req: Req, st: ReqEvictState, logical: array, limit: int, floor: int
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
        and node.parent.children.get(node.key.child_key(tree.page_size)) is node
    ):
        depth = len(node.key) + len(node.vt.view.tail)
        if floor < depth <= limit:
            return node, depth
    st.prefix.restored = None
    ns = host_history.host_key(history.namespace(req, st), req.cache_salt)
    hit = host_history.find(tier, ns, logical, limit, floor)
    if hit is None or not host_history.restorable(hit[0].row.positions, hit[1], tree.page_size):
        return None  # none, or cut where it kept nothing: never "does not fit yet"
    node = host_history.restore(tree, req, st, *hit)
    st.prefix.restored, st.prefix.restore_blocked = node, node is None
    return None if node is None else (node, hit[1])


def _plain(
    tree: RadixTree, req: Req, st: ReqEvictState, result: MatchResult, key: RadixKey
) -> MatchResult:
    """A plain prefill's match (`_observed`); matched for its first chunk, it sets where the
    request's own prompt begins (`Prefix.matched`)."""
    result = _observed(tree, result, key, st)
    if not req.kv.holds_kv:
        st.prefix.matched = result.device_prefix_len
    return result


def _observed(
    tree: RadixTree, result: MatchResult, key: RadixKey, st: ReqEvictState | None
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
    return RadixCache.match_prefix(
        tree,
        MatchPrefixParams(
            key=RadixKey(
                key.token_ids,
                key.extra_key,
                is_bigram=key.is_bigram,
                limit=cap,
                cache_salt=key.cache_salt,
            )
        ),
    )


def prefix_device_indices(tree: RadixTree, req: Req) -> torch.Tensor:
    """`HoledRadixCache.prefix_device_indices`: a request continuing a stored view starts from
    its slots, its own copy of the view's partial last page included; any other as SGLang's."""
    st = state_of(req)
    hit = st.prefix.hit if st is not None else None
    if st is not None and hit is not None and req.last_node is hit.node:
        if not history_pages.own_tail(tree, req, st):  # admission copied it (admission.py)
            raise RuntimeError("no free page for the copy of a stored view's last page")
        own = st.prefix.hit  # the view with the request's own last page (own_tail)
        assert own is not None
        return own.slots
    return RadixCache.prefix_device_indices(tree, req)
