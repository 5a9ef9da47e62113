"""Retraction keeps what was evicted: a retracted evicting request resumes from its compacted row
(its `Retraction`, `st.retract`), so its output stays the masked-reference output.

BEFORE `release_req` the row's live K/V and positions are copied to host memory (the stash);
when the radix cache matches the request again (`resume`) the stash is written into fresh slots
as a holed view under a namespace of its own, and the request continues from it like a turn
from a stored history, prefilling only its last output token; AFTER `prepare_for_extend` it gets
its real outputs back. Which row is stashed (overlap scheduler: the one before this step's
eviction, `undo_step`) and when a request is re-prefilled instead: docs/design/step.md,
"Retraction".
"""

from __future__ import annotations

from array import array
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchResult

from ..cache import history
from ..cache.pool import alloc
from ..core.records import MovedRow, RetractStash, RowBefore, StepUndo
from ..core.report import Report
from ..core.row import Row
from ..core.state import ReqEvictState, state_of

if TYPE_CHECKING:
    from sgl_vtoken.step import Decision

    from ..core.sglang_types import KVPool, RadixTree, Req, ScheduleBatch, TreeNode
    from .context import DueRow, StepContext


@dataclass
class Retraction:
    """A request's retraction state (`st.retract`)."""

    stash: RetractStash | None = None  # its row while retracted
    resume_node: TreeNode | None = None  # the radix node its stash was written back to
    real_outputs: array | None = None  # a resumed request's outputs while its prefill is set up
    undo: StepUndo | None = None  # this step's state before its fold and eviction
    resume_prefill: bool = False  # its prefill is a resume's (the row ends there)
    retractions: int = 0
    blocked: bool = False  # retracted, and its view does not fit the pool yet

    def start_step(self, stats: torch.Tensor | None) -> None:
        """A step starts for this request (a decode step, or a prefill chunk's eviction): a
        resumed view is its row now (the stash is dropped), and `stats`, the statistics as they
        are now (`Stats.snapshot`), are what `undo_step` goes back to."""
        self.stash, self.resume_prefill = None, False
        self.undo = StepUndo(stats)

    def resume(
        self,
        tree: RadixTree,
        req: Req,
        st: ReqEvictState,
        logical: array,
        limit: int,
        result: MatchResult,
    ) -> MatchResult:
        """`HoledRadixCache.match_prefix` of a retracted request (`st`, whose part this is): its
        stashed row, written back into the tree if the tree no longer holds it; with no room for
        it yet, the plain `result`, and the request is `blocked` (not admitted this round).
        Called through the part, so the cache never imports the step layer."""
        stash, node = self.stash, self.resume_node
        assert stash is not None, "resume() of a request that was not retracted"
        if stash.depth > limit:  # no longer its ids (it was aborted: a one-token prompt)
            self.drop()
            return result
        if (
            node is None
            or node.parent is None
            or history.view_of(node) is None
            or node.parent.children.get(node.key.child_key(tree.page_size)) is not node
        ):
            node = _insert_stash(tree, stash, req)
        self.resume_node, self.blocked = node, node is None
        if node is None:
            return result
        view = node.vt.view
        adopt_retracted(req, st, logical, view.positions, stash.depth)
        st.prefix.continue_from(node, view.slots, 0)
        # At page size > 1 the view's partial last page becomes the request's own (`own_tail`).
        n = len(view.positions)
        return MatchResult(
            device_prefix_len=n,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            cache_protected_len=n // tree.page_size * tree.page_size,
        )

    def drop(self) -> None:
        """The request will not resume (it ends): its stash goes."""
        self.stash, self.resume_node, self.blocked = None, None, False

    def save_victims(self, moved: MovedRow) -> None:
        """Before a repack (page size > 1, overlap scheduler): the victims' K/V, copied while
        the repack has not yet written over them, for the `save_undo` that follows."""
        assert self.undo is not None, "an eviction saves its undo after its step started"
        self.undo = self.undo._replace(victims=moved)

    def save_undo(
        self, slots: torch.Tensor, positions: torch.Tensor, row: Row, report: Report
    ) -> None:
        """Before an eviction is recorded (holed cache): remember the row (`slots` at logical
        `positions`), `row`'s positions and counts and the `report` as they are, for
        `undo_step`; at page size > 1 with the victims `save_victims` kept, else the row before
        is lost."""
        assert self.undo is not None, "an eviction saves its undo after its step started"
        self.undo = self.undo._replace(
            before=RowBefore(
                slots, positions, row.snapshot(), report.snapshot(), self.undo.victims
            ),
            victims=None,
        )

    def lose_undo(self) -> None:
        """This step evicted in place and kept no victims: the row before cannot come back."""
        if self.undo is not None:
            self.undo = self.undo._replace(lost=True, victims=None)

    def restore_outputs(self, req: Req) -> None:
        """A resumed request gets its real outputs back (its prefill is set up, or it was not
        admitted this round); its prompt stays in row coordinates."""
        if self.real_outputs is not None:
            req.output_ids, self.real_outputs = self.real_outputs, None
            req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids


def keep_victims(ctx: StepContext, d: Decision, due: list[DueRow], active: list[bool]) -> None:
    """The eviction step's victims, before its repack writes over them: the `active` rows of
    `d` (`due`, one per row) whose reclaim strategy `saves_victims` keep their victims' K/V
    (every layer, on the device), on the stream the repack then runs on, so that a retraction
    in this step resumes from the row before it (`MovedRow`, `stash_row`)."""
    saving = [
        (b, row.st)
        for b, row in enumerate(due)
        if active[b] and row.st.reclaim.saves_victims(ctx, row.st)
    ]
    if not saving:
        return
    w = d.keep.shape[1]
    keeps = [d.keep[b, : d.rows[b].length] for b, _ in saving]
    victims = [(~k).nonzero().flatten() for k in keeps]
    flat = torch.cat([b * w + v for (b, _), v in zip(saving, victims)])
    view = ctx.view
    with ctx.stream or nullcontext():
        slots = d.raw.flatten().index_select(0, flat.to(d.raw.device, non_blocking=True))
        keys = torch.stack([buf[slots] for buf in view.k_buffers])
        values = torch.stack([buf[slots] for buf in view.v_buffers])
    sizes = [v.numel() for v in victims]
    for (_, st), keep, k, v in zip(saving, keeps, keys.split(sizes, 1), values.split(sizes, 1)):
        st.retract.save_victims(MovedRow(keep, k, v))


def before_release_req(*args: object, req: Req, tree_cache: RadixTree, **kwargs: object) -> None:
    """BEFORE `schedule_batch.release_req` (retraction only): stash an evicting request's row;
    without a stash it is re-prefilled with full attention, which the report says."""
    st = state_of(req)
    if (
        st is None
        or req.finished()
        or not req.kv.holds_kv
        or not (st.row.steps or st.prefix.hit is not None)
    ):
        return None
    if not req.output_ids:
        # Overlap scheduler: the step SGLang drops is its prefill (its first output id is not
        # back yet). It is prefilled again as it was first, so its eviction in this step is
        # undone and nothing is stashed: a resume would prefill one token where the prefill's
        # observation window spans `obs_window` queries.
        undo_step(st)
        return None
    # Without the holed cache, or with Naive-Evict's held pages: re-prefilled, stash None.
    resumable = st.holed and (st.cfg.page_size == 1 or st.cfg.reclaim == "vtoken")
    stash = stash_row(req, st, tree_cache) if resumable else None
    if stash is None:
        st.report.reprefill()
    else:
        st.retract.retractions += 1
        # A new stash: the node an earlier retraction resumed from (evictable now) is not its row.
        st.retract.stash, st.retract.resume_node = stash, None
    return None


def undo_step(st: ReqEvictState) -> RowBefore | None:
    """A retraction drops this step: the statistics go back to its start and its eviction, if
    any, is undone (`Retraction.start_step`, `save_undo`), once: a request retracted again before
    its next step (just resumed) has nothing left to undo. Returns the row before that eviction,
    or None when the step did not evict."""
    undo, st.retract.undo = st.retract.undo, None  # consumed: a second retraction before the
    if undo is None:  # next step finds the state already undone
        return None
    st.stats.restore(undo.stats)
    if undo.before is None:
        return None
    st.row.restore(undo.before.row)
    st.report.restore(undo.before.report)
    return undo.before


def stash_row(req: Req, st: ReqEvictState, tree_cache: RadixTree) -> RetractStash | None:
    """Copy the row the request resumes from (K/V of every layer, positions) to host memory, and
    put its policy state back to that moment (docs/design/step.md, "Retraction"). Returns None when
    that row is gone (`StepUndo.lost`) or holds no whole page of ids: re-prefilled then.

    Overlap scheduler: the last output id was the input of the in-flight step, which SGLang
    drops; the resume prefills it again over the row it was first computed over, the row before
    this step's eviction (page size 1: the evicted slots are freed but not yet reused; above:
    the kept entries where the repack put them, the victims from their copy). No overlap: the
    last output id has no KV yet, and the resume prefills it over the row as it is, as this
    step's decode would have."""
    ids = st.prompt.logical_ids(req)
    depth, row_len = len(ids) - 1, req.kv.kv_committed_len
    in_flight = row_len + st.row.offset == len(ids)  # the row covers the last output id
    before = None
    if in_flight:
        if st.retract.undo is not None and st.retract.undo.lost:
            return None
        before = undo_step(st)
    else:  # this step's fold and eviction stand: nothing to undo
        st.retract.undo = None
    req_to_token = tree_cache.req_to_token_pool.req_to_token
    if before is not None:  # this step evicted: the row before it
        slots, positions = before.slots, before.positions
    else:
        slots, positions = (
            req_to_token[req.kv.req_pool_idx, :row_len].to(torch.int64),
            st.row.positions(row_len),
        )
    if depth < tree_cache.page_size:
        return None  # no whole page of logical ids to key its view by
    live = int((positions < depth).sum())  # positions ascend: the kept entries are a row prefix
    pool = tree_cache.token_to_kv_pool_allocator.get_kvcache()
    device = tree_cache.token_to_kv_pool_allocator.device
    if before is not None and before.moved is not None:
        now = req_to_token[req.kv.req_pool_idx].to(torch.int64)
        keys, values = _moved_kv(pool, before.moved, now, live, device)
    else:
        index = slots[:live].to(device)
        keys = torch.stack([pool.get_key_buffer(layer)[index] for layer in range(pool.layer_num)])
        values = torch.stack(
            [pool.get_value_buffer(layer)[index] for layer in range(pool.layer_num)]
        )
    serial = st.retract.retractions + 1  # `before_release_req` counts this retraction
    namespace = f"{req.extra_key or ''}|{st.cfg.history_namespace()}|retract:{req.rid}:{serial}"
    return RetractStash(
        ids=ids[:depth],
        positions=positions[:live].cpu(),
        keys=keys.cpu(),
        values=values.cpu(),
        namespace=namespace,
    )


def _moved_kv(
    pool: KVPool, moved: MovedRow, row: torch.Tensor, live: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[layers, live, kv_heads, head_dim]`` of the first `live` entries of the row before a
    repack: kept entries from the row as it is now (`row`, its slot table row; they lead it in
    order), victims from `moved`'s copy (in row order, so those among the first `live` lead it)."""
    keep = moved.keep[:live].to(device)
    kept = row[: int(moved.keep[:live].sum())]
    victims = live - kept.numel()
    if moved.keys.is_cuda:  # copied on the repack's stream (rare path: wait for every stream)
        torch.cuda.synchronize(moved.keys.device)
    out = []
    pairs = ((pool.get_key_buffer, moved.keys), (pool.get_value_buffer, moved.values))
    for buffers, saved in pairs:
        first = buffers(0)
        kv = first.new_empty(pool.layer_num, live, *first.shape[1:])
        kv[:, keep] = torch.stack([buffers(layer)[kept] for layer in range(pool.layer_num)])
        kv[:, ~keep] = saved[:, :victims]
        out.append(kv)
    return out[0], out[1]


def _insert_stash(tree: RadixTree, stash: RetractStash, req: Req) -> TreeNode | None:
    """The stash's row put back into the tree (`history.insert_row`) in fresh slots (whole pages
    at page size > 1, the last one partly filled), or None when the pool cannot give them now."""
    ps = tree.page_size
    slots = alloc(tree, -(-stash.positions.numel() // ps) * ps, req, "resume")
    if slots is None:
        return None
    return history.insert_row(
        tree, slots, stash.ids, stash.positions, stash.keys, stash.values, stash.namespace
    )


def adopt_retracted(
    req: Req, st: ReqEvictState, logical: array, positions: torch.Tensor, depth: int
) -> None:
    """Resume a retracted request from its view. SGLang prefills `origin + output` past the
    prefix, but the view may hold fewer entries than the request has outputs (outputs evicted
    too). Until its prefill is prepared the request is therefore split at the view instead:
    origin = the view's prompt entries, output = the view's output entries + the ids past
    `depth` (the last output); `after_prepare_for_extend` puts the real outputs back. Its row
    positions continue at `depth`."""
    prompt_len = len(logical) - len(req.output_ids)
    pos = positions.tolist()
    st.prompt.adopt(req, array("q", (logical[p] for p in pos if p < prompt_len)))
    outputs = array("q", (logical[p] for p in pos if p >= prompt_len)) + logical[depth:]
    st.retract.real_outputs, req.output_ids = req.output_ids, outputs
    req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
    st.row.start_at(positions, depth)


def after_prepare_for_extend(result: None, batch: ScheduleBatch) -> None:
    """AFTER `ScheduleBatch.prepare_for_extend`: SGLang set up the prefills; a resumed request
    gets its real outputs back, and its prefill is a resume's (its row ends there;
    `scores.prepare`)."""
    for req in batch.reqs:
        st = state_of(req)
        if st is not None and st.retract.real_outputs is not None:
            st.retract.restore_outputs(req)
            st.retract.resume_prefill = True
