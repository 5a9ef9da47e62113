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

import torch

from sgl_vtoken.step import EvictRow, KVPoolView, apply, decide

from ..cache import host_tier
from ..state import ReqEvictState, state_of
from ..surface.counters import counters_of
from ..surface.model_support import kv_bytes_per_token
from ..surface.observe import sample_held
from ..tp import tp_gather
from . import held


def evict_batch(scheduler, batch, skip: set) -> bool:
    """Evict every request of `batch` whose row reached its trigger, in one pass
    (`sgl_vtoken.step`); update the batch lengths. Returns whether the batch holds any evicting
    request."""
    evicting = [(i, req, st) for i, req in enumerate(batch.reqs)
                if (st := state_of(req)) is not None]
    if not evicting:
        return False
    c = counters_of(scheduler)
    if not c.bytes_per_token:  # first eviction on a server without a policy: read the pool now
        c.bytes_per_token = kv_bytes_per_token(scheduler.token_to_kv_pool_allocator.get_kvcache())
    sample_held(scheduler)  # rows as prefilled, before this step's eviction
    for i, req, st in evicting:
        # Decoding again; a retraction later in this step resumes from here.
        st.retract.start_step(st.stats.snapshot())
        st.stats.fold(getattr(scheduler, "tp_group", None))
    seq_lens_cpu = batch.seq_lens_cpu
    due = []
    for i, req, st in evicting:
        row_len = int(seq_lens_cpu[i])
        if req not in skip and st.cfg.should_evict(row_len):
            due.append((req, st, row_len))
    freed_before = c.pages_freed
    evicted = evict_rows(scheduler, due) if due else []
    new_lens = seq_lens_cpu.clone()
    index = {id(req): i for i, req, _ in evicting}
    for (req, _, row_len), n in zip(due, evicted):
        new_lens[index[id(req)]] = row_len - n
    if c.pages_freed > freed_before:
        # SGLang stops admitting after a failed admission until the batch shrinks; memory
        # freed by eviction must reopen admission the same way.
        batch.batch_is_full = False
    if not any(evicted):
        return True
    _shift_lens(batch, seq_lens_cpu - new_lens)
    return True


def _shift_lens(batch, delta: torch.Tensor) -> None:
    """Every row of `batch` is `delta[i]` entries shorter (negative: longer). New tensors: the
    in-flight forward (overlap scheduler) keeps reading the old ones."""
    batch.seq_lens_cpu = batch.seq_lens_cpu - delta
    batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.orig_seq_lens = batch.orig_seq_lens - delta.to(batch.orig_seq_lens.device, batch.orig_seq_lens.dtype)
    batch.seq_lens_sum = None


def evict_rows(scheduler, due: list) -> list[int]:
    """Evict the rows of `due` (``(req, state, row_len)``) down to their budgets in one pass:
    view -> keep -> plan on the device (`step.decide`), the tree's part row by row on the host
    (relock, release, pages for copies), then one repack, one row write (`step.apply`) and one
    allocator free. Returns the tokens each row evicted (0: not this step)."""
    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    ps = allocator.page_size
    for req, st, row_len in due:
        if st.holed and st.row.steps == 0 and st.prefix.hit is None:
            # The prompt's KV is full attention: share it before the first eviction (under the
            # overlap scheduler the prefill checkpoint may not have landed yet; then a no-op).
            tree.checkpoint(req, up_to=req.extend_end)
            st.naive.mark_tree_owned(req.kv.cache_protected_len)
        kv = req.kv
        assert kv.kv_committed_len == row_len == kv.kv_allocated_len, (
            f"row {row_len} != committed {kv.kv_committed_len} / allocated {kv.kv_allocated_len}")
    rows = [_row(req, st, row_len) for req, st, row_len in due]
    kvcache = allocator.get_kvcache()
    tp_group = getattr(scheduler, "tp_group", None)
    view = KVPoolView(scheduler.req_to_token_pool.req_to_token, kvcache.k_buffer, kvcache.v_buffer, ps,
                      tp_gather=None if tp_group is None or tp_group.world_size == 1
                      else lambda t, dim: tp_gather(t, tp_group, dim))
    d = decide(rows, view)
    tier = host_tier.tier_of()
    if tier is not None and any(st.cfg.host.offload for _, st, _ in due):
        host_tier.offload(tier, [(st, d.raw[b, :r.length][~d.keep[b, :r.length].to(d.raw.device)],
                                  r.positions[~d.keep[b, :r.length]])
                                 for b, ((_, st, _), r) in enumerate(zip(due, rows)) if st.cfg.host.offload],
                          kvcache.k_buffer, kvcache.v_buffer)
    copies, active = [], []
    for b, (req, st, row_len) in enumerate(due):
        w, n_copy, cpl = d.counts["whole"][b], d.counts["copies"][b], rows[b].cpl
        slots = alloc_slots(scheduler, -(-n_copy // ps) * ps) if n_copy else d.raw[b, :0]
        copies.append(d.raw[b, :0] if slots is None else slots)
        active.append(slots is not None)  # no free page for the copies: retry at the next step
        if slots is None or not st.holed or w == cpl:
            continue
        if ps == 1 and st.prefix.hit is not None:  # its own stored history: free what nobody reaches
            gone = d.raw[b, :cpl][~d.keep[b, :cpl].to(d.raw.device)]
            freed = tree.release_dropped(req, gone.to(st.prefix.hit.slots.device))
            counters_of(scheduler).pages_freed += freed
            st.row.count_freed(freed)
        elif ps == 1 or st.cfg.reclaim == "vtoken":
            # Whole pages need not be a prefix (sinks, then a later run): lock up to the last one.
            # (Naive-Evict keeps its lock at page size > 1: see held.hold_naive_pages.)
            tree.relock_shallower(req, d.counts["depth"][b])
    stream = getattr(scheduler, "forward_stream_ctx", None) if view.req_to_token.is_cuda else None
    out = apply(d, view, copies, active, move_stream=stream)
    freed_rows = iter(torch.split(out.freed, out.freed_counts))
    to_free, evicted = [], []
    c = counters_of(scheduler)
    for b, (req, st, row_len) in enumerate(due):
        if not active[b]:
            evicted.append(0)
            continue
        if ps > 1 and st.holed and st.prefix.hit is not None:  # its stored history: free what nobody reaches
            row = view.req_to_token[req.kv.req_pool_idx, :d.new_length(b)]
            freed = tree.release_unused_pages(req, row.to(torch.int64))
            c.pages_freed += freed
            st.row.count_freed(freed)
        evicted.append(_record(st, req, rows[b], d, b, next(freed_rows), to_free, tree))
        c.evictions += 1
    if to_free:
        pages = torch.cat(to_free).to(allocator.device)
        if pages.numel():
            (allocator.free if ps == 1 else allocator.free_page_ids)(pages)
            c.pages_freed += int(pages.numel())
    c.evicted_tokens += sum(evicted)
    c.tokens_moved += out.moved
    c.bytes_moved += out.moved * c.bytes_per_token
    return evicted


def _row(req, st: ReqEvictState, row_len: int) -> EvictRow:
    accumulator, pinned = st.stats.accumulator, st.recall.pinned
    attn = accumulator.stats if accumulator is not None else None
    if attn is not None and attn.shape[0] != row_len:
        raise RuntimeError(f"attention statistics cover {attn.shape[0]} tokens, the row {row_len}")
    positions = st.row.positions(row_len)
    return EvictRow(row=req.kv.req_pool_idx, length=row_len, positions=positions,
                    policy=st.policy, budget=st.cfg.budget, cpl=req.kv.cache_protected_len,
                    shared=not st.holed, rid=st.rid, step=st.row.steps, attn=attn,
                    pinned=None if pinned is None else torch.isin(positions, pinned))


def _record(st: ReqEvictState, req, row: EvictRow, d, b: int, freed: torch.Tensor, to_free: list,
            tree) -> int:
    """Row `b` of decision `d` was applied: follow it in the request's state; add the pages to
    free to `to_free` (Naive-Evict holds some back). Returns the tokens evicted."""
    keep, kv = d.keep_indices(b), req.kv
    if st.holed and st.cfg.page_size == 1:  # what a retraction in this step resumes from
        st.retract.save_undo(d.raw[b, :row.length], row.positions, st.row, st.report)
    st.stats.select(keep)
    w, n_copy = d.counts["whole"][b], d.counts["copies"][b]
    if st.holed and (w != row.cpl or n_copy):  # the view changed below cpl
        kv.cache_protected_len = w
    new_len = d.new_length(b)
    kept_pos = row.positions[keep]
    if st.cfg.reclaim == "naive" and st.cfg.page_size > 1:
        own = new_len - w if st.holed else new_len  # pinned tree tokens are its own
        freed = held.hold_naive_pages(st, kept_pos, int(row.positions[-1]) + 1, own, freed.cpu())
        if st.holed:
            tree.relock_shallower(req, st.naive.tree_lock)
    to_free.append(freed)
    evicted = row.length - new_len
    st.row.record(kept_pos, evicted, int(freed.numel()))
    st.report.update(evicted_tokens=st.report["evicted_tokens"] + evicted, live_tokens=int(kept_pos.numel()),
                     pages_freed=st.row.freed, evictions=st.row.steps)
    kv.kv_committed_len -= evicted
    kv.kv_allocated_len -= evicted
    return evicted


def alloc_slots(scheduler, n: int) -> torch.Tensor | None:
    """`n` slots (whole pages) from the pool, evicting unlocked radix-cache nodes if needed."""
    allocator = scheduler.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        scheduler.tree_cache.evict(EvictParams(num_tokens=n))
    return allocator.alloc(n) if allocator.available_size() >= n else None
