"""`--kv-reclaim naive`: the Naive-Evict baseline inside the same server, for benchmarks.

Naive-Evict drops the same victims from attention but never moves a token, so a page returns to
the pool only when every token on it is dead. Its footprint is therefore the number of distinct
pages among live tokens: a token at logical position p sits on the request's page p // page_size
(plus the page the next token goes to). The server computes exactly that and holds back, out of
the pages vToken compaction would free, as many as Naive-Evict could not free. The KV layout is
the compacted one (same attention, same outputs); only the pool sees Naive-Evict's footprint.

Prompts are cached and shared as in vToken mode (same victims, same caching): tree-owned tokens
leave the row's view the same way, but Naive-Evict keeps its lock on the shared pages up to the
last one with a live token instead of moving it to the whole-page prefix. At page size > 1 the
compacted layout copies kept tokens of partly kept shared pages into the request's own pages,
which Naive-Evict would not do; when packing does not save as many pages as those copies cost,
the emulation holds more than Naive-Evict would, and says how much (`naive_excess_pages`).

Held pages are counted as the request's own in SGLang's pool accounting (`kv_private_tokens`),
returned when Naive-Evict would free them, and all freed when the request releases its KV.
"""

from __future__ import annotations

import torch

from sgl_vtoken.pages import num_pages

from .state import state_of

# id(ReqKvInfo) -> pages held back for that request (ReqKvInfo has __slots__).
HELD_PAGES: dict[int, int] = {}


def naive_page_count(kept_pos: torch.Tensor, next_pos: int, page_size: int) -> int:
    """Pages a Naive-Evict cache holds for live tokens at `kept_pos` whose next token is `next_pos`."""
    pages = torch.unique(torch.cat([kept_pos // page_size, kept_pos.new_tensor([(next_pos - 1) // page_size])]))
    return int(pages.numel())


def hold_naive_pages(st, kept_pos: torch.Tensor, next_pos: int, own_len: int, kv,
                     freed: torch.Tensor) -> torch.Tensor:
    """Keep back the pages Naive-Evict could not free; return those to really free now.

    Positions below `st.tree_len` were tree-owned when the request first evicted: Naive-Evict
    keeps the shared pages referenced up to the last live one (`st.tree_lock` tokens, the caller
    moves the request's lock there) and its own pages wherever a live private token sits. The row
    holds `own_len` private slots (kept private tokens plus copies of kept tree tokens, packed);
    a copy is a page Naive-Evict would not hold, so when packing saves fewer pages than the
    copies cost, the emulation holds `st.naive_excess` pages more than Naive-Evict would.
    """
    ps = st.cfg.page_size
    tree = kept_pos < st.tree_len
    st.tree_lock = int(kept_pos[tree].max()) + 1 if bool(tree.any()) else 0
    wanted = naive_page_count(kept_pos[~tree], next_pos, ps) - num_pages(own_len, ps)
    extra, st.naive_excess = max(0, wanted), max(0, -wanted)
    pool = torch.cat([torch.tensor(st.naive_pages, dtype=torch.int64), freed.to(torch.int64)])
    st.naive_pages = pool[:extra].tolist()
    if st.naive_pages:
        HELD_PAGES[id(kv)] = len(st.naive_pages)
    else:
        HELD_PAGES.pop(id(kv), None)
    return pool[extra:]


def release_held(req, allocator) -> int:
    """Free every page `req` holds back (request release or retraction); returns the count."""
    st = state_of(req)
    if st is None or not st.naive_pages:
        return 0
    n = len(st.naive_pages)
    allocator.free_page_ids(torch.tensor(st.naive_pages, dtype=torch.int64, device=allocator.device))
    st.naive_pages = []
    HELD_PAGES.pop(id(req.kv), None)
    return n


def around_kv_private_tokens(original, kv, page_size: int) -> int:
    """AROUND `pool_stats_observer.kv_private_tokens`: held pages are the request's own."""
    return original(kv, page_size) + HELD_PAGES.get(id(kv), 0) * page_size
