"""How an evicting row gives memory back: one strategy per request (`Slots` at page size 1,
`Pages` above, `NaivePages` under `--kv-reclaim naive`), chosen from its settings when the
request is made (`reclaim_for`), so the step (`eviction.py`) does not branch on page size and
reclaim mode inside its loops. Each strategy does the tree's part of a holed row (relock,
release its history's unused slots or pages) and says what of the freed memory goes back now.
Table: docs/design/step.md, "Reclaim strategies".

The step's tree phase is here, before its repack: `tree_part` (pages for the copies of kept
tree-owned tokens, or the row's own prompt detached; the strategies' release). After the repack
the step records each row's outcome through its strategy (`Reclaim.record`, called by
`eviction.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.step import Decision, EvictRow

from ..cache import pool
from ..core.state import ReqEvictState
from . import held
from .context import DueRow, RowOutcome, StepContext

if TYPE_CHECKING:
    from ..core.sglang_types import Req


class Reclaim:
    """The interface; each method is one point of the step (`eviction.evict_rows`), and `record`
    the template that carries a row's outcome into its state."""

    def record(
        self, ctx: StepContext, due: DueRow, row: EvictRow, d: Decision, b: int, freed: torch.Tensor
    ) -> RowOutcome:
        """Row `b` of decision `d` was applied (`freed`: the pages `apply` emptied in it): its
        strategy releases what its stored history no longer needs and says what of `freed` to
        return now; the request's state and lengths follow. Returns what it decided."""
        req, st, _ = due
        keep, new_len, kv = d.keep_indices(b), d.new_length(b), req.kv
        w, n_copy = d.counts[b].whole, d.counts[b].copies
        kept_pos = row.positions[keep]
        own = new_len - w if st.holed else new_len  # pinned tree tokens are its own
        if st.holed:  # its stored history: free what nobody reaches
            self.release_history(ctx, req, st, partial(d.kept_tree_pages, b))
        self.before_record(st, d.raw[b, : row.length], row.positions)
        freed = self.to_free(ctx, req, st, kept_pos, int(row.positions[-1]) + 1, own, freed)
        st.stats.select(keep)
        if st.holed and (w != row.cpl or n_copy):  # the view changed below cpl
            kv.cache_protected_len = w
            if row.own_from is not None:  # its history attaches where its tree part ends
                st.prefix.cap_attach(d.counts[b].depth)
        evicted = row.length - new_len
        st.row.record(kept_pos, evicted, int(freed.numel()))
        st.report.record_eviction(evicted, int(kept_pos.numel()), st.row.freed, st.row.steps)
        kv.kv_committed_len -= evicted
        kv.kv_allocated_len -= evicted
        return RowOutcome(evicted, freed)

    def release_tree(
        self, ctx: StepContext, req: Req, st: ReqEvictState, dropped: torch.Tensor, depth: int
    ) -> None:
        """Before the repack, for a holed row whose view changed below its protected length:
        `dropped` the logical positions (host) of the tree-owned entries it no longer uses,
        `depth` the tokens of the tree path its kept entries still reach."""

    def saves_victims(self, ctx: StepContext, st: ReqEvictState) -> bool:
        """Whether the row's victims' K/V are copied before the repack writes over them, so a
        retraction in this step can resume from the row before it (`records.MovedRow`)."""
        return False

    def before_record(
        self, st: ReqEvictState, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """The row (`slots` at logical `positions`) is about to change in the request's state."""

    def release_history(
        self, ctx: StepContext, req: Req, st: ReqEvictState, kept_pages: Callable[[], torch.Tensor]
    ) -> None:
        """After the repack, for a holed row: free what of its stored history nobody reaches any
        more. `kept_pages()`: the host ids of the tree-owned pages the row still references."""

    def to_free(
        self,
        ctx: StepContext,
        req: Req,
        st: ReqEvictState,
        kept_pos: torch.Tensor,
        next_pos: int,
        own: int,
        freed: torch.Tensor,
    ) -> torch.Tensor:
        """Of `freed` (the slots or pages the repack released), those to return now; the row
        keeps entries at logical `kept_pos`, its next token is at `next_pos`, `own` of its
        entries are its own (not tree-owned)."""
        return freed


class Slots(Reclaim):
    """Page size 1: the row is compacted and its dead slots freed."""

    def release_tree(
        self, ctx: StepContext, req: Req, st: ReqEvictState, dropped: torch.Tensor, depth: int
    ) -> None:
        if st.prefix.hit is None:
            ctx.tree.relock_shallower(req, depth)
            return
        freed = ctx.tree.release_dropped(req, dropped)
        ctx.counters.pages_freed += freed
        st.row.count_freed(freed)

    def before_record(
        self, st: ReqEvictState, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        if st.holed:  # what a retraction in this step resumes from
            st.retract.save_undo(slots, positions, st.row, st.report)


class Pages(Reclaim):
    """Page size > 1: kept tokens are packed onto the request's own pages and whole pages freed."""

    def release_tree(
        self, ctx: StepContext, req: Req, st: ReqEvictState, dropped: torch.Tensor, depth: int
    ) -> None:
        # Whole pages need not be a prefix (sinks, then a later run): lock up to the last one.
        ctx.tree.relock_shallower(req, depth)

    def saves_victims(self, ctx: StepContext, st: ReqEvictState) -> bool:
        # Only the overlap scheduler resumes from the row before the step (retraction.py).
        return st.holed and ctx.overlap

    def before_record(
        self, st: ReqEvictState, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        if not st.holed:
            return
        if st.retract.undo is not None and st.retract.undo.victims is not None:
            st.retract.save_undo(slots, positions, st.row, st.report)
        else:  # the repack moved kept tokens onto evicted ones: the row before is gone
            st.retract.lose_undo()

    def release_history(
        self, ctx: StepContext, req: Req, st: ReqEvictState, kept_pages: Callable[[], torch.Tensor]
    ) -> None:
        if st.prefix.hit is None:
            return
        freed = ctx.tree.release_unused_pages(req, kept_pages())
        ctx.counters.pages_freed += freed
        st.row.count_freed(freed)


class NaivePages(Pages):
    """`--kv-reclaim naive` at page size > 1: the same layout, but the pages a Naive-Evict cache
    could not free are held back by the request (`held.py`)."""

    def saves_victims(self, ctx: StepContext, st: ReqEvictState) -> bool:
        return False  # its held pages are not kept: a retracted request is re-prefilled

    def release_tree(
        self, ctx: StepContext, req: Req, st: ReqEvictState, dropped: torch.Tensor, depth: int
    ) -> None:
        pass  # Naive-Evict keeps its lock on the shared pages: moved in `to_free`

    def to_free(
        self,
        ctx: StepContext,
        req: Req,
        st: ReqEvictState,
        kept_pos: torch.Tensor,
        next_pos: int,
        own: int,
        freed: torch.Tensor,
    ) -> torch.Tensor:
        freed = held.hold_naive_pages(st, kept_pos, next_pos, own, freed)
        if st.holed:
            ctx.tree.relock_shallower(req, st.naive.tree_lock)
        return freed


_STRATEGIES = {"slots": Slots(), "pages": Pages(), "naive": NaivePages()}


def reclaim_for(cfg: EvictConfig) -> Reclaim:
    """The reclaim strategy of a request evicting under `cfg` (the strategies hold no state)."""
    if cfg.page_size == 1:
        return _STRATEGIES["slots"]
    return _STRATEGIES["naive" if cfg.reclaim == "naive" else "pages"]


class TreePart(NamedTuple):
    """What the tree's part of a step gives its repack (`step_apply.apply`), per row: `active`,
    whether it is carried out (False: no page for its copies of kept tree-owned tokens, the row
    is left as it is for a later step), `copies`, the slots those copies go to (`apply`'s
    `copy_slots`; empty for a row left as it is), and `onto_own`, whether those are its own
    prompt part's slots (that part left the tree)."""

    active: list[bool]
    copies: list[torch.Tensor]
    onto_own: list[bool]


def tree_part(ctx: StepContext, due: list[DueRow], d: Decision) -> TreePart:
    """Before the repack of decision `d` (`due`, one per row): every row's copies get fresh pages
    first (an allocation may evict unlocked tree nodes, and the nodes a relock below unlocks are
    still the row a retraction in this step resumes from). A row that gets none, and whose
    copies all come from its own prompt part (`Decision.own_copies`), takes that part out of the
    tree when only it holds it (`radix.HoledRadixCache.detach_own`) and its copies go there
    (docs/design/cache.md, "Own prompt"). Then each holed row whose view changed below its protected
    length releases what it no longer uses of the tree (its strategy's `release_tree`)."""
    ps = ctx.page_size
    copies = [
        pool.alloc(ctx.tree, -(-c.copies // ps) * ps, req) if c.copies else d.raw[b, :0]
        for b, ((req, _, _), c) in enumerate(zip(due, d.counts))
    ]
    onto_own = [False] * len(due)
    for b, (req, st, _) in enumerate(due):
        row = d.rows[b]
        if copies[b] is None and row.own_from is not None and d.own_copies[b]:
            own = ctx.tree.detach_own(req, st.prefix.matched or 0, row.cpl - row.own_from)
            if own is not None:  # else nothing changed: the row is evicted at a later step
                copies[b], onto_own[b] = own.to(d.raw.device), True
    for b, (req, st, _) in enumerate(due):
        w, cpl = d.counts[b].whole, d.rows[b].cpl
        if copies[b] is not None and st.holed and w != cpl:  # its view changed below cpl
            dropped = d.rows[b].positions[:cpl][~d.keep[b, :cpl]]  # host: no device read
            st.reclaim.release_tree(ctx, req, st, dropped, d.counts[b].depth)
    active = [c is not None for c in copies]
    return TreePart(
        active, [d.raw[b, :0] if c is None else c for b, c in enumerate(copies)], onto_own
    )
