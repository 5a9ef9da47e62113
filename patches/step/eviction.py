"""The decode eviction step: every due row of a batch evicted in one pass before SGLang's decode
memory check (AROUND `Scheduler.update_running_batch`), lengths fixed in row coordinates.

`evict_batch` finds the due rows (`DueRow`) and fixes the batch's lengths; `evict_rows` carries
them through `sgl_vtoken.step` (decide, the tree's part, apply) and records each row's outcome
(`RowOutcome`). The interval arithmetic and the ownership rules are in docs/design.md ("Row
coordinates", "Splice rules"); `prefill.py` evicts a prefill chunk through `evict_rows` too.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from sgl_vtoken.step import (
    Decision,
    EvictRow,
    apply,
    copies_in_own_part,
    decide,
    pack_onto_own,
)

from ..cache import host_tier, pool
from ..core.process import process
from ..core.state import state_of
from . import pressure
from .context import DueRow, RowOutcome, StepContext
from .retraction import MovedRow

if TYPE_CHECKING:
    from ..core.sglang_types import Req, ScheduleBatch
    from ..core.state import ReqEvictState


def evict_batch(
    ctx: StepContext,
    batch: ScheduleBatch,
    skip: set[Req],
    waiting: Sequence[Req] = (),
    places: int = 1 << 30,
) -> None:
    """Evict every request of `batch` (SGLang's `ScheduleBatch`) whose row reached its trigger, in
    one pass, skipping the requests in `skip` (finishing in flight): rows under the budget
    trigger at ``budget + interval``, rows under the pressure trigger when the pool is short
    (`pressure.due_rows`; `waiting` SGLang's waiting queue, `places` how many more requests
    the batch could take). Fix the batch's lengths and sample the pool gauges before and after."""
    evicting = [
        (i, req, st) for i, req in enumerate(batch.reqs) if (st := state_of(req)) is not None
    ]
    ctx.sample_held()  # rows as prefilled, before this step's eviction
    for _, _, st in evicting:
        # Decoding again; a retraction later in this step resumes from here.
        st.retract.start_step(st.stats.snapshot())
        st.stats.fold(ctx.tp_group)
    seq_lens_cpu = batch.seq_lens_cpu
    lens = seq_lens_cpu.tolist()
    rows = [(i, DueRow(req, st, lens[i])) for i, req, st in evicting if req not in skip]
    due = [(i, row) for i, row in rows if not row.st.cfg.on_pressure and _reached(row)]
    pressed = [(i, row) for i, row in rows if row.st.cfg.on_pressure]
    if pressed:
        pressed = pressure.due_rows(ctx, batch, pressed, waiting, places)
        due = sorted(due + pressed, key=lambda x: x[0])
    # the logical length of each row compacted under pressure, for its report (`evicted_at`)
    at = {i: int(row.st.row.positions(row.length)[-1]) + 1 for i, row in pressed}
    freed_before = ctx.counters.pages_freed
    outcomes = evict_rows(ctx, [row for _, row in due]) if due else []
    delta = torch.zeros_like(seq_lens_cpu)
    for (i, row), n in zip(due, outcomes):
        if n is None:  # no free page for its copies: evicted at a later step (shortage.py)
            ctx.counters.deferred_evictions += 1
            row.st.report.defer_eviction()
            process().shortages.note("eviction_deferred", row.req.rid)
        else:
            delta[i] = n
            if i in at:
                row.st.report.record_pressure(at[i])
    if ctx.counters.pages_freed > freed_before:
        # SGLang stops admitting after a failed admission until the batch shrinks; memory
        # freed by eviction must reopen admission the same way.
        batch.batch_is_full = False
    if any(outcomes):
        _shift_lens(batch, delta)
    ctx.sample_held()
    ctx.sample_batch(batch)


def _reached(row: DueRow) -> bool:
    return row.st.cfg.should_evict(row.length)


def _shift_lens(batch: ScheduleBatch, delta: torch.Tensor) -> None:
    """Every row of `batch` is `delta[i]` entries shorter. New tensors: the in-flight forward
    (overlap scheduler) keeps reading the old ones."""
    batch.seq_lens_cpu = batch.seq_lens_cpu - delta
    batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.orig_seq_lens = batch.orig_seq_lens - delta.to(
        batch.orig_seq_lens.device, batch.orig_seq_lens.dtype
    )
    batch.seq_lens_sum = None


def evict_rows(ctx: StepContext, due: list[DueRow]) -> list[int | None]:
    """Evict the rows of `due` down to their budgets in one pass: view -> keep -> plan on the
    device (`step.decide`), the tree's part row by row on the host (each request's reclaim
    strategy, `reclaim.py`; pages for copies), then one repack, one row write (`step.apply`) and
    one allocator free. Returns the tokens each row evicted (`RowOutcome.evicted`)."""
    ps, view = ctx.page_size, ctx.view
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
    rows = [_evict_row(ctx, row) for row in due]
    d = decide(rows, view)
    if ctx.tier is not None and any(row.st.cfg.host.offload for row in due):
        _offload(ctx, d, [(b, row.st) for b, row in enumerate(due) if row.st.cfg.host.offload])
    # Every row's copies first: an allocation may evict unlocked tree nodes, and the nodes a
    # relock below unlocks are still the row a retraction in this step resumes from.
    copies = [
        pool.alloc(ctx.tree, -(-c.copies // ps) * ps, req) if c.copies else d.raw[b, :0]
        for b, ((req, _, _), c) in enumerate(zip(due, d.counts))
    ]
    detached: list[
        torch.Tensor
    ] = []  # slots (page ids above page size 1) of detached own prompts the rows drop
    for b, (req, st, _) in enumerate(due):
        if copies[b] is None and rows[b].own_from is not None:
            copies[b] = _detach_own(ctx, d, b, req, st, detached)
    for b, (req, st, _) in enumerate(due):
        w, cpl = d.counts[b].whole, rows[b].cpl
        if copies[b] is not None and st.holed and w != cpl:  # its view changed below cpl
            dropped = rows[b].positions[:cpl][~d.keep[b, :cpl]]  # host: no device read
            st.reclaim.release_tree(ctx, req, st, dropped, d.counts[b].depth)
    active = [c is not None for c in copies]
    saving = [
        (b, row.st)
        for b, row in enumerate(due)
        if active[b] and row.st.reclaim.saves_victims(ctx, row.st)
    ]
    if saving:
        _save_victims(ctx, d, saving)
    out = apply(
        d,
        view,
        [d.raw[b, :0] if c is None else c for b, c in enumerate(copies)],
        active,
        move_stream=ctx.stream,
    )
    freed_rows = iter(torch.split(out.freed, out.freed_counts))
    outcomes = [
        row.st.reclaim.record(ctx, row, rows[b], d, b, next(freed_rows))
        if active[b]
        else RowOutcome(None, d.raw[b, :0])
        for b, row in enumerate(due)
    ]
    freed = torch.cat([o.free for o in outcomes] + detached).to(ctx.allocator.device)
    if freed.numel():  # slots at page size 1, page ids above
        (ctx.allocator.free if ps == 1 else ctx.allocator.free_page_ids)(freed)
        ctx.counters.pages_freed += int(freed.numel())
    evicted = [o.evicted for o in outcomes]
    ctx.counters.evictions += sum(n is not None for n in evicted)
    ctx.counters.evicted_tokens += sum(n for n in evicted if n)
    ctx.counters.tokens_moved += out.moved
    ctx.counters.bytes_moved += out.moved * ctx.counters.bytes_per_token
    return evicted


def _offload(ctx: StepContext, d: Decision, offloading: list[tuple[int, ReqEvictState]]) -> None:
    """The victims of the rows `offloading` (``(b, state)``) go to the host tier before their
    slots are freed or overwritten: their row entries are known on the host (`d.keep`), so one
    index copy to the device gathers their slots, and the copies run on the stream that then
    moves KV (no host synchronization)."""
    assert ctx.tier is not None
    w = d.keep.shape[1]
    victims = [(~d.keep[b, : d.rows[b].length]).nonzero().flatten() for b, _ in offloading]
    flat = torch.cat([b * w + v for (b, _), v in zip(offloading, victims)])
    with ctx.stream or nullcontext():
        slots = d.raw.flatten().index_select(0, flat.to(d.raw.device, non_blocking=True))
        host_tier.offload(
            ctx.tier,
            [(st, d.rows[b].positions[v]) for (b, st), v in zip(offloading, victims)],
            slots,
            ctx.view.k_buffers,
            ctx.view.v_buffers,
        )


def _detach_own(
    ctx: StepContext,
    d: Decision,
    b: int,
    req: Req,
    st: ReqEvictState,
    detached: list[torch.Tensor],
) -> torch.Tensor | None:
    """No free page for row `b`'s copies of its own prompt: when only it holds that part of the
    tree (`radix.HoledRadixCache.detach_own`) and every copy comes from it, the part leaves the
    tree and the copies are packed onto its own slots (`step.pack_onto_own`; docs/design.md,
    "Own prompt"). Returns the copies' slots, or None (nothing changed: the row is evicted at a
    later step). The part's pages (slots at page size 1) the row no longer needs go to
    `detached`."""
    row, own_from = d.rows[b], d.rows[b].own_from
    assert own_from is not None, "only a row with an own part detaches it"
    if not copies_in_own_part(d, b, own_from, row.cpl):
        return None  # a copy from a partly kept shared page would land where a later one reads
    own = ctx.tree.detach_own(req, st.prefix.matched or 0, row.cpl - own_from)
    if own is None:
        return None
    slots, free = pack_onto_own(d, b, own.to(d.raw.device), ctx.page_size)
    detached.append(free.to(ctx.allocator.device))
    return slots


def _save_victims(ctx: StepContext, d: Decision, saving: list[tuple[int, ReqEvictState]]) -> None:
    """The rows `saving` (``(b, state)``) keep their victims' K/V (every layer, on the device)
    before the repack writes over them, on the stream the repack then runs on: a retraction in
    this step resumes from the row before it (`retraction.MovedRow`)."""
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


def _evict_row(ctx: StepContext, due: DueRow) -> EvictRow:
    """What `step.decide` reads of a due row: its positions, policy, budget, statistics, and its
    entries' units when the policy keeps words whole (a `span`)."""
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
        # and the rest of the prompt is the tree's to evict (docs/design.md, "Own prompt").
        own_from = int((positions[:cpl] < matched).sum())
    return EvictRow(
        row=req.kv.req_pool_idx,
        length=length,
        positions=positions,
        policy=st.policy,
        budget=st.cfg.row_budget,
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
