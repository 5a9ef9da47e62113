"""The eviction step: the due rows (`DueRow`) of one pass evicted down to their budgets (or a
shortage's level, `pressure.py`), in phases that each hand the next what they return.
`evict_rows` is its one entry: the decode step (`decode.py`) and the eviction between two
prefill chunks (`prefill.py`) call it::

    prepare   a holed row's prompt shared before its first eviction; the planner's rows (EvictRow)
    decide    scores, keep masks, index plan, one device-to-host copy (sgl_vtoken.step) -> Decision
    offload   the offloading rows' victims to the host tier (host_tier.offload_victims)
    tree      pages for the copies of kept tree-owned tokens, or the row's own prompt part
              detached; the tree's release (reclaim.tree_part) -> TreePart
    victims   the victims' K/V a retraction in this step resumes from (retraction.keep_victims)
    apply     one repack, one row write (sgl_vtoken.step_apply) -> Applied
    record    each row's outcome through its reclaim strategy (Reclaim.record) -> RowOutcome
    free      one allocator call
    count     the server's counters (VTokenCounters.count_step)

The order is the order of their side effects (docs/design/library.md, "The repack planner").
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from sgl_vtoken.step import Decision, EvictRow, decide
from sgl_vtoken.step_apply import Applied, apply

from ..cache import host_tier
from . import reclaim
from .context import DueRow, RowOutcome, StepContext
from .retraction import keep_victims


def evict_rows(
    ctx: StepContext, due: list[DueRow], keep: Sequence[int | None] = ()
) -> list[int | None]:
    """Evict the rows of `due` in one pass (the phases above), each down to `keep[i]` tokens (a
    shortage's level, `pressure.py`) or, where None or not given, its budget. Returns the tokens
    each row evicted (`RowOutcome.evicted`; None: left as it is, no page for its copies)."""
    rows = _prepare(ctx, due, keep)
    d = decide(rows, ctx.view)
    host_tier.offload_victims(ctx.tier, d, [row.st for row in due], ctx.view, ctx.stream)
    tree = reclaim.tree_part(ctx, due, d)
    keep_victims(ctx, d, due, tree.active)
    out = apply(
        d, ctx.view, tree.copies, tree.active, move_stream=ctx.stream, onto_own=tree.onto_own
    )
    outcomes = record(ctx, due, d, out, tree.active)
    freed = free(ctx, outcomes, out)
    evicted = [o.evicted for o in outcomes]
    ctx.counters.count_step(evicted, freed, out.moved)
    return evicted


def record(
    ctx: StepContext, due: list[DueRow], d: Decision, out: Applied, active: list[bool]
) -> list[RowOutcome]:
    """After the repack (`out`): each `active` row's outcome through its strategy (`Reclaim.record`:
    what of the pages it emptied goes back now, its state and lengths); a row left as it is
    evicted nothing (`RowOutcome.evicted` None)."""
    freed_rows = iter(torch.split(out.freed, out.freed_counts))
    return [
        row.st.reclaim.record(ctx, row, d.rows[b], d, b, next(freed_rows))
        if active[b]
        else RowOutcome(None, d.raw[b, :0])
        for b, row in enumerate(due)
    ]


def free(ctx: StepContext, outcomes: list[RowOutcome], out: Applied) -> int:
    """One allocator call for the step: what each row gives back now, then the pages of the own
    prompt parts its copies left empty (`Applied.released`). Returns how many pages (slots at
    page size 1) went back."""
    device = ctx.allocator.device
    freed = torch.cat([o.free for o in outcomes] + [r.to(device) for r in out.released])
    freed = freed.to(device)
    if freed.numel():  # slots at page size 1, page ids above
        (ctx.allocator.free if ctx.page_size == 1 else ctx.allocator.free_page_ids)(freed)
    return int(freed.numel())


def _prepare(ctx: StepContext, due: list[DueRow], keep: Sequence[int | None]) -> list[EvictRow]:
    """What `step.decide` reads of each due row (`EvictRow`). A holed row evicting for the first
    time shares its prompt first (a checkpoint into the tree)."""
    for req, st, length in due:
        if st.holed and st.row.steps == 0 and st.prefix.hit is None:
            # The prompt's KV is full attention: share it before the first eviction. Under the
            # overlap scheduler SGLang's own checkpoint of the prefill lands after this step
            # began; it is then a no-op (radix.checkpoint), so sharing never depends on timing.
            ctx.tree.checkpoint(req, up_to=req.extend_end)
            st.naive.mark_tree_owned(req.kv.cache_protected_len)
        kv = req.kv
        assert kv.kv_committed_len == length == kv.kv_allocated_len, (
            f"row {length} != committed {kv.kv_committed_len} / allocated {kv.kv_allocated_len}"
        )
    keep = list(keep) + [None] * (len(due) - len(keep))
    return [_evict_row(ctx, row, n) for row, n in zip(due, keep)]


def _evict_row(ctx: StepContext, due: DueRow, keep: int | None) -> EvictRow:
    """What `step.decide` reads of a due row: its positions, policy, budget (`keep` when given),
    statistics, and its entries' units when the policy keeps words whole (a `span`)."""
    req, st, length = due
    accumulator, pinned = st.stats.accumulator, st.recall.pinned
    attn = accumulator.stats if accumulator is not None else None
    if attn is not None and attn.shape[0] != length:
        raise RuntimeError(f"attention statistics cover {attn.shape[0]} tokens, the row {length}")
    positions = st.row.positions(length)
    cpl = req.kv.cache_protected_len
    own_from = None
    matched = st.prefix.matched
    if st.holed and st.prefix.hit is None and matched is not None and st.cfg.reclaim == "vtoken":
        # Its own prompt tokens (past what the tree held at its match) leave the tree for its
        # own pages once its eviction keeps them: its lock then moves up to the shared prefix
        # and the rest of the prompt is the tree's to evict (docs/design/cache.md, "Own prompt").
        own_from = int((positions[:cpl] < matched).sum())
    return EvictRow(
        row=req.kv.req_pool_idx,
        length=length,
        positions=positions,
        policy=st.policy,
        budget=st.cfg.row_budget if keep is None else keep,
        cpl=cpl,
        shared=not st.holed,
        rid=st.rid,
        step=st.row.steps,
        attn=attn,
        pinned=None if pinned is None else torch.isin(positions, pinned),
        history=st.holed and st.prefix.hit is not None and st.cfg.page_size > 1,
        own_from=own_from,
        units=_units(ctx, st.prompt.logical_ids(req), positions, st.policy.span)
        if st.policy.span
        else None,
    )


def _units(ctx: StepContext, ids: array, positions: torch.Tensor, span: int) -> torch.Tensor:
    """``[L] int64`` the unit of each row entry (`sgl_vtoken.units`), from the request's logical
    token ids `ids` (``array("q")``, prompt then output: a position indexes them)."""
    end = int(positions[-1]) + 1
    if end > len(ids):
        raise RuntimeError(f"row position {end - 1} is past the request's {len(ids)} token ids")
    return ctx.words.unit_starts(torch.frombuffer(ids[:end], dtype=torch.int64), span)[positions]
