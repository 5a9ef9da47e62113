"""The decode eviction step's trigger: before SGLang's decode memory check (AROUND
`Scheduler.update_running_batch`), every row of the running batch that reached its trigger is
evicted in one pass through the eviction step (`eviction.evict_rows`), and the batch's lengths
are fixed in row coordinates. The interval arithmetic and the ownership rules are in
docs/design/library.md, "Row coordinates", and docs/design/splice.md, "Splice rules"; the
pressure trigger is `pressure.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..core.process import process
from ..core.state import state_of
from . import pressure
from .context import DueRow, StepContext
from .eviction import evict_rows

if TYPE_CHECKING:
    from ..core.sglang_types import Req, ScheduleBatch


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
    # under pressure: the length each compacted row goes down to (the others: their budget)
    to = {i: t for i, _, t in pressure.due_rows(ctx, batch, pressed, waiting, places)}
    if to:
        due = sorted(due + [(i, row) for i, row in pressed if i in to], key=lambda x: x[0])
    # the logical length of each row compacted under pressure, for its report (`evicted_at`)
    at = {i: int(row.st.row.positions(row.length)[-1]) + 1 for i, row in due if i in to}
    freed_before = ctx.counters.pages_freed
    outcomes = evict_rows(ctx, [row for _, row in due], [to.get(i) for i, _ in due]) if due else []
    # A row short of pages for its copies at its level goes to its budget, which copies less
    # (`pressure.copy_room` keeps that much free); a row deferred even then waits a step.
    again = [
        k
        for k, ((i, row), n) in enumerate(zip(due, outcomes))
        if n is None and i in to and to[i] > row.st.cfg.row_budget
    ]
    if again:
        for k in again:
            to[due[k][0]] = due[k][1].st.cfg.row_budget
        retried = evict_rows(ctx, [due[k][1] for k in again], [to[due[k][0]] for k in again])
        for k, n in zip(again, retried):
            outcomes[k] = n
    delta = torch.zeros_like(seq_lens_cpu)
    for (i, row), n in zip(due, outcomes):
        if n is None:  # no free page for its copies: evicted at a later step (shortage.py)
            ctx.counters.deferred_evictions += 1
            row.st.report.defer_eviction()
            process().shortages.note("eviction_deferred", row.req.rid)
        else:
            delta[i] = n
            if i in at:
                row.st.report.record_pressure(at[i], to[i])
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
