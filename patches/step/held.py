"""`--kv-reclaim naive`: the Naive-Evict baseline inside the same server, for benchmarks.

Same victims, same compacted KV and outputs; only the pool sees Naive-Evict's footprint: out of
the pages compaction frees, the server holds back (`NaiveHold`, `st.naive`) as many as
Naive-Evict could not free (a page returns only when every token on it is dead). Held pages
count as the request's own in SGLang's memory checks (at page size > 1 through a `ReqKvInfo`
subclass with a `held_for` slot, `count_held`), and all go back when the request releases its
KV. Design: docs/design/step.md, "Naive-Evict inside the server".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from sgl_vtoken.pages import num_pages

from ..core.state import ReqEvictState, state_of

if TYPE_CHECKING:
    from ..core.sglang_types import Allocator, KvInfo, Req


@dataclass
class NaiveHold:
    """What the Naive-Evict emulation holds for a request (`st.naive`)."""

    held: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int64)
    )  # page ids held back
    tree_lock: int = 0  # tree tokens its lock still covers
    excess: int = 0  # pages held beyond Naive-Evict's own footprint
    tree_len: int = 0  # row positions below were tree-owned at its first eviction

    def mark_tree_owned(self, tree_len: int) -> None:
        """First eviction under the holed cache: the row's first `tree_len` positions are
        tree-owned (the shared prompt), which the accounting needs later."""
        self.tree_len = tree_len

    def hold(self, pages: torch.Tensor, tree_lock: int, excess: int) -> None:
        """The request now holds back `pages` (int64 page ids, any device), its lock covers the
        first `tree_lock` tree tokens, `excess`: pages held beyond Naive-Evict's."""
        self.held, self.tree_lock, self.excess = pages, tree_lock, excess

    def release(self) -> torch.Tensor:
        """The pages held back, which the caller returns to the pool; none are held after."""
        pages, self.held = self.held, self.held[:0]
        return pages

    def reset(self) -> None:
        """Retraction: the row is gone (its held pages went back with its KV)."""
        self.tree_len = self.tree_lock = self.excess = 0


def naive_page_count(kept_pos: torch.Tensor, next_pos: int, page_size: int) -> int:
    """Pages a Naive-Evict cache holds for live tokens at `kept_pos` whose next token is
    `next_pos`."""
    pages = torch.unique(
        torch.cat([kept_pos // page_size, kept_pos.new_tensor([(next_pos - 1) // page_size])])
    )
    return int(pages.numel())


def hold_naive_pages(
    st: ReqEvictState, kept_pos: torch.Tensor, next_pos: int, own_len: int, freed: torch.Tensor
) -> torch.Tensor:
    """Keep back the pages Naive-Evict could not free; return those to really free now.

    Positions below `tree_len` were tree-owned when the request first evicted: Naive-Evict
    keeps the shared pages referenced up to the last live one (`tree_lock` tokens, the caller
    moves the request's lock there) and its own pages wherever a live private token sits. The row
    holds `own_len` private slots (kept private tokens plus copies of kept tree tokens, packed);
    a copy is a page Naive-Evict would not hold, so when packing saves fewer pages than the
    copies cost, the emulation holds `excess` pages more than Naive-Evict would (`NaiveHold`).
    """
    ps, hold = st.cfg.page_size, st.naive
    tree = kept_pos < hold.tree_len
    tree_lock = int(kept_pos[tree].max()) + 1 if bool(tree.any()) else 0
    wanted = naive_page_count(kept_pos[~tree], next_pos, ps) - num_pages(own_len, ps)
    extra = max(0, wanted)
    pool = torch.cat(
        [hold.held.to(freed.device), freed.to(torch.int64)]
    )  # counts known: no device read
    hold.hold(pool[:extra], tree_lock, max(0, -wanted))
    return pool[extra:]


def release_held(req: Req, allocator: Allocator) -> int:
    """Free every page `req` holds back (request release or retraction); returns the count."""
    st = state_of(req)
    if st is None or not len(st.naive.held):
        return 0
    pages = st.naive.release()
    allocator.free_page_ids(pages.to(allocator.device))
    return len(pages)


_KV_CLASSES: dict[type, type] = {}


def count_held(req: Req, st: ReqEvictState) -> None:
    """From now on SGLang counts the pages `st` holds back as `req`'s own: `req.kv` (fresh, at
    request creation) becomes the same record with a `held_for` slot."""
    base = type(req.kv)
    if base not in _KV_CLASSES:

        @dataclass(slots=True, kw_only=True)
        class HeldKvInfo(base):  # type: ignore[valid-type,misc]  # base: req.kv's runtime class
            held_for: ReqEvictState | None = field(default=None, repr=False, compare=False)

        HeldKvInfo.__qualname__ = f"VToken{base.__qualname__}"
        _KV_CLASSES[base] = HeldKvInfo
    values = {f.name: getattr(req.kv, f.name) for f in fields(req.kv) if f.init}
    req.kv = _KV_CLASSES[base](**values, held_for=st)


def around_kv_private_tokens(
    original: Callable[[KvInfo, int], int], kv: KvInfo, page_size: int
) -> int:
    """AROUND `pool_stats_observer.kv_private_tokens`: held pages are the request's own."""
    st = getattr(kv, "held_for", None)
    return original(kv, page_size) + (len(st.naive.held) * page_size if st is not None else 0)
