"""Eviction under memory pressure (`trigger` "pressure"): a row keeps every token while the pool
holds what the running rows and the requests waiting for a place in the batch need; when it
cannot, the longest rows are compacted to one level, no further than the pool needs, never below
their budget. The budget is the floor, and a row within `interval` of it is not evicted at all.

At each decode step, before SGLang's decode memory check (`decode.evict_batch`)::

    free      = free slots + evictable tree slots
    need      = a page for every running row's next token
              + each evicting row's growth to its decode peak (what admission reserved for it,
                `reserve`)
              + the pages one row's compaction to its budget may copy (`copy_room`)
              + the prefill and reservation of the waiting requests the batch has places for,
                in queue order, as many as would fit with every row at its budget
    shortfall = need - free
    compact   rows with row_len >= budget + interval down to one level L, the highest whose
              surplus covers the shortfall plus `interval` tokens for every row under the
              pressure trigger (`levels`); each compacted row gives at least `interval`

At page size > 1 a compaction first copies the kept tokens of tree-owned pages it keeps only in
part into fresh pages (`reclaim.tree_part`): the pool must still hold those pages when the
shortage is met, or the compaction is put off while the rows grow into the last page and SGLang
aborts a request. `copy_room` keeps that much free once the rows' remaining tokens no longer
fit the pool (a request the pool holds to its end keeps every token), and a row whose
compaction to its level finds no page for its copies goes to its budget in the same step
(`decode.evict_batch`), which copies at most its budget.

With no shortfall nothing is evicted and a row's output is the full cache's. The margin of
`interval` tokens a row lets the rows grow that many steps before the next shortage, as the
budget trigger evicts a row once every `interval` steps. Rows under the budget trigger are
evicted at their own trigger as before, whatever the pool holds.
docs/design/step.md, "Eviction under memory pressure".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING

from ..core.state import ReqEvictState, state_of
from .context import DueRow, StepContext

if TYPE_CHECKING:
    from ..core.sglang_types import Req, ScheduleBatch

TRIGGER = "pressure"


def reserve(st: ReqEvictState, own: int) -> int:
    """KV tokens an evicting request holding `own` tokens of its own may still add: up to its
    decode peak (admission reserves this much; a row above its peak gives back, under pressure,
    whatever it holds above its budget)."""
    return max(0, st.cfg.decode_peak - own)


def own_tokens(req: Req, st: ReqEvictState) -> int:
    """The running request's KV tokens not owned by the radix tree (under the holed cache the
    tree-owned ones leave the row as it evicts; the whole row otherwise)."""
    return req.kv.kv_committed_len - (req.kv.cache_protected_len if st.holed else 0)


def growth(req: Req) -> int:
    """Tokens running request `req` may still add (its max_new_tokens less its outputs)."""
    cap = req.sampling_params.max_new_tokens
    return 1 << 30 if cap is None else max(0, cap - len(req.output_ids))


def copy_room(rows: Iterable[DueRow], page_size: int) -> int:
    """Slots a compaction of one of `rows` to its budget may take for copies at `page_size` > 1:
    the most any of them keeps of its tree-owned tokens (at most its budget), in whole pages,
    plus a page. 0 at page size 1: no page is kept in part there, and a row's own prompt part,
    the one thing copied, leaves the tree instead when no page is free (`reclaim.tree_part`)."""
    if page_size == 1:
        return 0
    most = max(
        (min(row.st.cfg.row_budget, row.req.kv.cache_protected_len) for row in rows), default=0
    )
    return (-(-most // page_size) + 1) * page_size if most else 0


def levels(
    lengths: Sequence[int],
    floors: Sequence[int],
    intervals: Sequence[int],
    shortfall: int,
    page_size: int,
) -> list[int | None]:
    """The length each candidate row is compacted to (None: it keeps every token), given its
    length, its floor (its budget) and its interval (``length >= floor + interval``): every row
    above one level L goes down to L, the highest page-aligned L whose surplus covers
    `shortfall`, and by at least its interval, never below its floor; none when `shortfall` <= 0,
    every row to its floor when even that does not cover it::

        A  |######################################|  900  ->  L
        B  |#########################|               600  ->  L
        C  |##############|                          340     (under L: kept whole)
        L  ------------------------------| 500: A gives 400, B 100, = 500 >= shortfall
    """
    if shortfall <= 0 or not lengths:
        return []

    def gives(level: int) -> int:
        return sum(max(0, n - max(level, f)) for n, f in zip(lengths, floors))

    lo, hi = min(floors), max(lengths)
    if gives(lo) < shortfall:
        level = lo
    else:  # the highest level that still covers: gives() falls as the level rises
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if gives(mid) >= shortfall else (lo, mid - 1)
        level = lo
    level -= level % page_size
    return [
        None if n <= level else max(f, min(level, n - iv) // page_size * page_size)
        for n, f, iv in zip(lengths, floors, intervals)
    ]


def demand(req: Req, page_size: int) -> int:
    """KV tokens waiting request `req` asks at admission: its uncached prompt (as last matched;
    the whole prompt before any match) and its reservation, plus a page."""
    ids = getattr(req, "full_untruncated_fill_ids", None) or req.origin_input_ids
    extend = max(0, len(ids) - int(getattr(req, "prefix_len", 0) or 0))
    st = state_of(req)
    grow = reserve(st, extend) if st is not None else 0
    return extend + grow + page_size


def admissible(demands: Iterable[int], room: int) -> int:
    """KV tokens of the longest run of `demands` (the waiting requests in queue order) whose sum
    fits in `room` (the slots the pool would have with every row at its budget): the queue is
    admitted in order, so a request that cannot fit stops the run."""
    total = 0
    for d in demands:
        if total + d > room:
            break
        total += d
    return total


def due_rows(
    ctx: StepContext,
    batch: ScheduleBatch,
    rows: Sequence[tuple[int, DueRow]],
    waiting: Sequence[Req] = (),
    places: int = 1 << 30,
) -> list[tuple[int, DueRow, int]]:
    """The rows of `rows` (``(batch index, row)``: the pressure-triggered requests of `batch`
    not finishing in flight) to compact at this step, each with the length it is compacted to.
    `waiting`: SGLang's waiting queue; `places`: how many more requests the batch could take
    (the running limit less its size)."""
    ps = ctx.page_size
    candidates = [
        (i, row) for i, row in rows if row.length >= row.st.cfg.row_budget + row.st.cfg.interval
    ]
    if not candidates:
        return []
    need = ps * len(batch.reqs)
    free = ctx.allocator.available_size() + ctx.tree.evictable_size()
    if need + sum(growth(req) for req in batch.reqs) > free:  # else no row ever compacts
        need += copy_room((row for _, row in candidates), ps)
    for req in batch.reqs:
        st = state_of(req)
        if st is not None and req.kv.holds_kv:
            need += reserve(st, own_tokens(req, st))
    floors = [row.st.cfg.row_budget for _, row in candidates]
    surplus = sum(row.length for _, row in candidates) - sum(floors)
    # lazily: the run stops at the first request that cannot fit, and the queue is not copied
    queue = (demand(req, ps) for req in islice(waiting, max(0, places)))
    need += admissible(queue, free + surplus - need)
    if need <= free:
        return []
    margin = sum(row.st.cfg.interval for _, row in rows)
    targets = levels(
        [row.length for _, row in candidates],
        floors,
        [row.st.cfg.interval for _, row in candidates],
        need - free + margin,
        ps,
    )
    return [(i, row, t) for (i, row), t in zip(candidates, targets) if t is not None]
