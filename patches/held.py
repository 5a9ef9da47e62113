"""`--kv-reclaim naive`: the Naive-Evict baseline inside the same server, for benchmarks.

Naive-Evict drops the same victims from attention but never moves a token, so a page returns to
the pool only when every token on it is dead. Its footprint is therefore the number of distinct
pages among live tokens: a token at logical position p sits on the request's page p // page_size
(plus the page the next token goes to). The server computes exactly that and holds back, out of
the pages vToken compaction would free, as many as Naive-Evict could not free. The KV layout is
the compacted one (same attention, same outputs); only the pool sees Naive-Evict's footprint.

Held pages are counted as the request's own in SGLang's pool accounting (`kv_private_tokens`),
returned when Naive-Evict would free them, and all freed when the request releases its KV.
"""

from __future__ import annotations

import torch

from sgl_vtoken.pages import num_pages

# id(ReqKvInfo) -> pages held back for that request (ReqKvInfo has __slots__).
HELD_PAGES: dict[int, int] = {}


def naive_page_count(kept_pos: torch.Tensor, next_pos: int, page_size: int) -> int:
    """Pages a Naive-Evict cache holds for live tokens at `kept_pos` whose next token is `next_pos`."""
    pages = torch.unique(torch.cat([kept_pos // page_size, kept_pos.new_tensor([(next_pos - 1) // page_size])]))
    return int(pages.numel())


def hold_naive_pages(st, kept_pos: torch.Tensor, next_pos: int, new_len: int, kv,
                     freed: torch.Tensor) -> torch.Tensor:
    """Keep back the pages Naive-Evict could not free; return those to really free now."""
    extra = max(0, naive_page_count(kept_pos, next_pos, st.cfg.page_size) - num_pages(new_len, st.cfg.page_size))
    pool = torch.cat([torch.tensor(st.naive_pages, dtype=torch.int64), freed.to(torch.int64)])
    st.naive_pages = pool[:extra].tolist()
    if st.naive_pages:
        HELD_PAGES[id(kv)] = len(st.naive_pages)
    else:
        HELD_PAGES.pop(id(kv), None)
    return pool[extra:]


def release_held(req, allocator) -> int:
    """Free every page `req` holds back (request release or retraction); returns the count."""
    st = getattr(req, "vtoken", None)
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
