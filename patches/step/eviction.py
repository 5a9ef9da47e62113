"""Token eviction in the scheduler: evict, reclaim, fix lengths, before the decode memory check.

Runs AROUND `Scheduler.update_running_batch`, so `check_decode_mem` already sees the reclaimed
memory, and before `prepare_for_decode` appends the slot of the incoming token. Every SGLang
length stays in row coordinates (splice rule 1, docs/design.md): after an eviction of `d` tokens the row holds
`budget` live slots and the request's position offset grows by `d`::

    row before (L = budget + interval)            row after (budget), offset += d
    | tree-owned [0, cpl) | private ........ |    | tree-owned | kept private |
    0                     cpl                L    0            cpl           budget
    logical position of row index j: kept_pos[j] for j < m (at the last eviction), j + offset after

Tree-owned slots are never freed or moved (splice rule 2). Under the holed radix cache
(`radix.py`) the policy may drop them from the row, which then stops using them (at page size > 1
the kept tokens of a partly dropped tree page are copied to the row's own pages), and what only
the row reached is freed; otherwise it sees them as shared and keeps them. Page size 1: the row is compacted and dead slots freed. Page size > 1: kept private tokens
move down onto the request's own pages (`dst <= src`, one all-layer KV move) and whole pages
are freed (splice rule 6); with `--kv-reclaim naive` the pages a Naive-Evict cache could not free stay
held by the request (see `held.py`).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch

from sgl_vtoken.step import EvictRow, apply, decide

from ..cache import host_tier
from ..core.process import process
from ..core.state import ReqEvictState, state_of
from .context import StepContext, context_of


def evict_batch(scheduler, batch, skip: set) -> StepContext | None:
    """Evict every request of `batch` whose row reached its trigger, in one pass
    (`sgl_vtoken.step`); update the batch lengths. Returns the scheduler's step context, or None
    when the batch holds no evicting request."""
    evicting = [
        (i, req, st) for i, req in enumerate(batch.reqs) if (st := state_of(req)) is not None
    ]
    if not evicting:
        return None
    ctx = context_of(scheduler)
    ctx.sample_held()  # rows as prefilled, before this step's eviction
    for i, req, st in evicting:
        # Decoding again; a retraction later in this step resumes from here.
        st.retract.start_step(st.stats.snapshot())
        st.stats.fold(ctx.tp_group)
    seq_lens_cpu = batch.seq_lens_cpu
    due = []
    for i, req, st in evicting:
        row_len = int(seq_lens_cpu[i])
        if req not in skip and st.cfg.should_evict(row_len):
            due.append((req, st, row_len))
    freed_before = ctx.counters.pages_freed
    evicted = evict_rows(ctx, due) if due else []
    new_lens = seq_lens_cpu.clone()
    index = {id(req): i for i, req, _ in evicting}
    for (req, st, row_len), n in zip(due, evicted):
        if n is None:  # no free page for its copies: evicted at a later step (shortage.py)
            ctx.counters.deferred_evictions += 1
            st.report["deferred_evictions"] = st.report.get("deferred_evictions", 0) + 1
            process().shortages.note("eviction_deferred", req.rid)
            continue
        new_lens[index[id(req)]] = row_len - n
    if ctx.counters.pages_freed > freed_before:
        # SGLang stops admitting after a failed admission until the batch shrinks; memory
        # freed by eviction must reopen admission the same way.
        batch.batch_is_full = False
    if any(evicted):  # a row evicted tokens
        _shift_lens(batch, seq_lens_cpu - new_lens)
    ctx.sample_held()
    return ctx


def _shift_lens(batch, delta: torch.Tensor) -> None:
    """Every row of `batch` is `delta[i]` entries shorter (negative: longer). New tensors: the
    in-flight forward (overlap scheduler) keeps reading the old ones."""
    batch.seq_lens_cpu = batch.seq_lens_cpu - delta
    batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.orig_seq_lens = batch.orig_seq_lens - delta.to(
        batch.orig_seq_lens.device, batch.orig_seq_lens.dtype
    )
    batch.seq_lens_sum = None


def evict_rows(ctx: StepContext, due: list) -> list[int | None]:
    """Evict the rows of `due` (``(req, state, row_len)``) down to their budgets in one pass:
    view -> keep -> plan on the device (`step.decide`), the tree's part row by row on the host
    (each request's reclaim strategy, `reclaim.py`; pages for copies), then one repack, one row
    write (`step.apply`) and one allocator free. Returns the tokens each row evicted; None for a
    row left as it was: no free page for the copies of its kept tree-owned tokens."""
    ps, view = ctx.page_size, ctx.view
    for req, st, row_len in due:
        if st.holed and st.row.steps == 0 and st.prefix.hit is None:
            # The prompt's KV is full attention: share it before the first eviction. Under the
            # overlap scheduler SGLang's own checkpoint of the prefill lands after this step
            # began; it is then a no-op (radix.checkpoint), so sharing never depends on timing.
            ctx.tree.checkpoint(req, up_to=req.extend_end)
            st.naive.mark_tree_owned(req.kv.cache_protected_len)
        kv = req.kv
        assert kv.kv_committed_len == row_len == kv.kv_allocated_len, (
            f"row {row_len} != committed {kv.kv_committed_len} / allocated {kv.kv_allocated_len}"
        )
    rows = [_row(req, st, row_len) for req, st, row_len in due]
    d = decide(rows, view)
    if ctx.tier is not None and any(st.cfg.host.offload for _, st, _ in due):
        _offload(ctx, d, [(b, st) for b, (_, st, _) in enumerate(due) if st.cfg.host.offload])
    copies, active = [], []
    for b, (req, st, row_len) in enumerate(due):
        w, n_copy, cpl = d.counts[b].whole, d.counts[b].copies, rows[b].cpl
        slots = ctx.alloc(-(-n_copy // ps) * ps, req) if n_copy else d.raw[b, :0]
        copies.append(d.raw[b, :0] if slots is None else slots)
        active.append(slots is not None)
        if slots is not None and st.holed and w != cpl:  # its view changed below cpl
            dropped = rows[b].positions[:cpl][~d.keep[b, :cpl]]  # host: no device read
            st.reclaim.release_tree(ctx, req, st, dropped, d.counts[b].depth)
    out = apply(d, view, copies, active, move_stream=ctx.stream)
    freed_rows = iter(torch.split(out.freed, out.freed_counts))
    to_free, evicted = [], []
    for b, (req, st, row_len) in enumerate(due):
        if not active[b]:
            evicted.append(None)
            continue
        evicted.append(_record(ctx, st, req, rows[b], d, b, next(freed_rows), to_free))
        ctx.counters.evictions += 1
    if to_free:
        ctx.free(torch.cat(to_free))
    ctx.counters.evicted_tokens += sum(n for n in evicted if n)
    ctx.counters.tokens_moved += out.moved
    ctx.counters.bytes_moved += out.moved * ctx.counters.bytes_per_token
    return evicted


def _offload(ctx: StepContext, d, offloading: list) -> None:
    """The victims of the rows `offloading` (``(b, state)``) go to the host tier before their
    slots are freed or overwritten: their row entries are known on the host (`d.keep`), so one
    index copy to the device gathers their slots, and the copies run on the stream that then
    moves KV (no host synchronization)."""
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


def _row(req, st: ReqEvictState, row_len: int) -> EvictRow:
    accumulator, pinned = st.stats.accumulator, st.recall.pinned
    attn = accumulator.stats if accumulator is not None else None
    if attn is not None and attn.shape[0] != row_len:
        raise RuntimeError(f"attention statistics cover {attn.shape[0]} tokens, the row {row_len}")
    positions = st.row.positions(row_len)
    return EvictRow(
        row=req.kv.req_pool_idx,
        length=row_len,
        positions=positions,
        policy=st.policy,
        budget=st.cfg.budget,
        cpl=req.kv.cache_protected_len,
        shared=not st.holed,
        rid=st.rid,
        step=st.row.steps,
        attn=attn,
        pinned=None if pinned is None else torch.isin(positions, pinned),
        history=st.holed and st.prefix.hit is not None and st.cfg.page_size > 1,
    )


def _record(
    ctx: StepContext,
    st: ReqEvictState,
    req,
    row: EvictRow,
    d,
    b: int,
    freed: torch.Tensor,
    to_free: list,
) -> int:
    """Row `b` of decision `d` was applied: its strategy releases what its stored history no
    longer needs and says what of `freed` to return now (added to `to_free`); the request's
    state follows. Returns the tokens evicted."""
    keep, new_len, kv = d.keep_indices(b), d.new_length(b), req.kv
    w, n_copy = d.counts[b].whole, d.counts[b].copies
    kept_pos = row.positions[keep]
    own = new_len - w if st.holed else new_len  # pinned tree tokens are its own
    if st.holed:  # its stored history: free what nobody reaches
        st.reclaim.release_history(ctx, req, st, partial(d.kept_tree_pages, b))
    st.reclaim.before_record(st, d.raw[b, : row.length], row.positions)
    freed = st.reclaim.to_free(ctx, req, st, kept_pos, int(row.positions[-1]) + 1, own, freed)
    to_free.append(freed)
    st.stats.select(keep)
    if st.holed and (w != row.cpl or n_copy):  # the view changed below cpl
        kv.cache_protected_len = w
    evicted = row.length - new_len
    st.row.record(kept_pos, evicted, int(freed.numel()))
    st.report.update(
        evicted_tokens=st.report["evicted_tokens"] + evicted,
        live_tokens=int(kept_pos.numel()),
        pages_freed=st.row.freed,
        evictions=st.row.steps,
    )
    kv.kv_committed_len -= evicted
    kv.kv_allocated_len -= evicted
    return evicted
