"""Token eviction in the scheduler: evict, reclaim, fix lengths, before the decode memory check.

Runs AROUND `Scheduler.update_running_batch`, so `check_decode_mem` already sees the reclaimed
memory, and before `prepare_for_decode` appends the slot of the incoming token. Every SGLang
length stays in row coordinates (splice rule 1, docs/design.md): after an eviction of `d` tokens the row holds
`budget` live slots and the request's position offset grows by `d`::

    row before (L = budget + interval)            row after (budget), offset += d
    | tree-owned [0, cpl) | private ........ |    | tree-owned | kept private |
    0                     cpl                L    0            cpl           budget
    logical position of row index j: kept_pos[j] for j < m (at the last eviction), j + offset after

Tree-owned slots are never freed or moved (splice rule 2). With compacted-history reuse (`radix.py`,
page size 1) the policy may drop them from the row, which then stops using them; otherwise it
sees them as shared and keeps them. Page size 1: the row is compacted and dead slots freed. Page size > 1: kept private tokens
move down onto the request's own pages (`dst <= src`, one all-layer KV move) and whole pages
are freed (splice rule 6); with `--kv-reclaim naive` the pages a Naive-Evict cache could not free stay
held by the request (see `held.py`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import torch

from sgl_vtoken.kernels import repack_kv_
from sgl_vtoken.planner import drop_tree_rows, plan_eviction, split_tree_pages
from sgl_vtoken.types import TokenView

from . import held
from .counters import counters_of
from .model_support import kv_bytes_per_token
from .observe import sample_held
from .state import ReqEvictState, state_of
from .tp import tp_gather


def evict_batch(scheduler, batch, skip: set) -> bool:
    """Evict every request of `batch` whose row reached its trigger; update the batch lengths.
    Returns whether the batch holds any evicting request."""
    evicting = [(i, req, st) for i, req in enumerate(batch.reqs)
                if (st := state_of(req)) is not None]
    if not evicting:
        return False
    c = counters_of(scheduler)
    if not c.bytes_per_token:  # first eviction on a server without a policy: read the pool now
        c.bytes_per_token = kv_bytes_per_token(scheduler.token_to_kv_pool_allocator.get_kvcache())
    sample_held(scheduler)  # rows as prefilled, before this step's eviction
    seq_lens_cpu = batch.seq_lens_cpu
    new_lens = None
    freed_before = counters_of(scheduler).pages_freed
    for i, req, st in evicting:
        st.start_step()  # decoding again; a retraction later in this step resumes from here
        if st.accumulator is not None:
            st.fold_staged(getattr(scheduler, "tp_group", None))
        if req in skip:
            continue
        row_len = int(seq_lens_cpu[i])
        if not st.cfg.should_evict(row_len):
            continue
        evicted = evict_request(scheduler, req, st, row_len)
        if evicted:
            new_lens = seq_lens_cpu.clone() if new_lens is None else new_lens
            new_lens[i] = row_len - evicted
    if counters_of(scheduler).pages_freed > freed_before:
        # SGLang stops admitting after a failed admission until the batch shrinks; memory
        # freed by eviction must reopen admission the same way.
        batch.batch_is_full = False
    if new_lens is None:
        return True
    delta = seq_lens_cpu - new_lens
    # New tensors: the in-flight forward (overlap scheduler) keeps reading the old ones.
    batch.seq_lens_cpu = new_lens
    batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
    batch.orig_seq_lens = batch.orig_seq_lens - delta.to(batch.orig_seq_lens.device, batch.orig_seq_lens.dtype)
    batch.seq_lens_sum = None
    return True


def _gather(get_buffer, layers: int, slots: torch.Tensor) -> torch.Tensor:
    """``[n, layers, H, D]`` cached keys or values of `slots` (`get_buffer`: the pool's
    `get_key_buffer` or `get_value_buffer`), for key- and value-based policies."""
    return torch.stack([get_buffer(layer)[slots] for layer in range(layers)], dim=1)


def evict_request(scheduler, req, st: ReqEvictState, row_len: int) -> int:
    """Evict one request down to its budget; returns the number of tokens evicted."""
    cfg, kv = st.cfg, req.kv
    if st.holed and st.steps == 0 and st.hit is None:
        # The prompt's KV is full attention: share it before the first eviction (under the overlap
        # scheduler the prefill checkpoint may not have landed yet; it is a no-op after this).
        scheduler.tree_cache.checkpoint(req, up_to=req.extend_end)
        st.mark_tree_owned(kv.cache_protected_len)
    assert kv.kv_committed_len == row_len == kv.kv_allocated_len, (
        f"row {row_len} != committed {kv.kv_committed_len} / allocated {kv.kv_allocated_len}")
    req_to_token = scheduler.req_to_token_pool.req_to_token
    allocator = scheduler.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    row_dev = req_to_token[kv.req_pool_idx, :row_len].to(torch.int64)
    row = row_dev.cpu()
    positions = st.positions(row_len)
    if st.holed and cfg.page_size == 1:
        st.save_undo(row, positions)
    cpl = kv.cache_protected_len
    keys = values = None  # every TP rank scores all KV heads: identical victims
    tp_group = getattr(scheduler, "tp_group", None)
    if "keys" in st.policy.needs:
        keys = tp_gather(_gather(pool.get_key_buffer, pool.layer_num, row_dev).cpu(), tp_group, dim=2)
    if "values" in st.policy.needs:
        values = tp_gather(_gather(pool.get_value_buffer, pool.layer_num, row_dev).cpu(), tp_group, dim=2)
    attn = st.accumulator.stats if st.accumulator is not None else None
    if attn is not None and attn.shape[0] != row_len:
        raise RuntimeError(f"attention statistics cover {attn.shape[0]} tokens, the row {row_len}")
    shared = None if st.holed else torch.arange(row_len) < cpl
    view = TokenView(positions=positions, keys=keys, attn=attn, shared=shared, rid=st.rid, step=st.steps,
                     values=values)
    keep = st.policy.keep(view, cfg.budget)
    left = LeftTree(row, keep, cpl, row[:0], row[:0])  # nothing leaves the tree
    if st.holed and cpl:
        left = _leave_tree(scheduler, req, st, row, keep, cpl, positions)
        if left is None:
            return 0  # no free page to copy kept shared tokens into: retry at the next step
    row, row_keep, new_cpl, copy_src, copy_dst = left
    st.select_stats(keep)
    plan = plan_eviction(row, row_keep, cpl=new_cpl, page_size=cfg.page_size)
    device = row_dev.device
    src, dst = torch.cat([copy_src, plan.src]), torch.cat([copy_dst, plan.dst])
    if src.numel():
        # GPU (splice rule 7, docs/design.md): move on the stream that runs forwards, after the in-flight forward
        # that may still write the last token's KV; row rewrites stay on the schedule stream.
        stream = getattr(scheduler, "forward_stream_ctx", None) if device.type == "cuda" else None
        with stream or nullcontext():
            repack_kv_(pool.k_buffer, pool.v_buffer, src.to(device), dst.to(device))
    if new_cpl != cpl or copy_src.numel():  # the view changed below cpl: rewrite the row from 0
        new_row = torch.cat([row[:plan.row_start], plan.row_slots])
        req_to_token[kv.req_pool_idx, :plan.new_len] = new_row.to(device, req_to_token.dtype)
        kv.cache_protected_len = new_cpl
    elif plan.row_slots.numel():
        req_to_token[kv.req_pool_idx, plan.row_start:plan.new_len] = plan.row_slots.to(
            device, req_to_token.dtype)
    kept_pos = positions[keep]
    freed = plan.freed_pages
    if cfg.reclaim == "naive" and cfg.page_size > 1:
        own = plan.new_len - new_cpl if st.holed else plan.new_len  # pinned tree tokens are its own
        freed = held.hold_naive_pages(st, kept_pos, int(positions[-1]) + 1, own, freed)
        if st.holed:
            scheduler.tree_cache.relock_shallower(req, st.tree_lock)
    if freed.numel():
        if cfg.page_size == 1:
            allocator.free(freed.to(device))
        else:
            allocator.free_page_ids(freed.to(device))

    evicted = row_len - plan.new_len
    st.record_eviction(kept_pos, evicted, int(freed.numel()))
    kv.kv_committed_len -= evicted
    kv.kv_allocated_len -= evicted
    c = counters_of(scheduler)
    c.evicted_tokens += evicted
    c.evictions += 1
    c.pages_freed += int(freed.numel())
    c.tokens_moved += int(src.numel())
    c.bytes_moved += int(src.numel()) * c.bytes_per_token
    return evicted


class LeftTree(NamedTuple):
    """The row as the planner gets it once tree-owned victims have left its view."""

    row: torch.Tensor       # slots of the row: kept tree slots, copies, then the private part
    keep: torch.Tensor      # kept row indices into `row`
    cpl: int                # tree-owned prefix of `row`
    copy_src: torch.Tensor  # kept shared slots copied into the request's own pages ...
    copy_dst: torch.Tensor  # ... and the slots they go to (page size > 1)


def _leave_tree(scheduler, req, st: ReqEvictState, row: torch.Tensor, keep: torch.Tensor, cpl: int,
                positions: torch.Tensor) -> LeftTree | None:
    """Let tree-owned victims leave the row's view (they are never freed by the request).

    Returns the row for the planner, or None when the pages to copy kept shared tokens into
    cannot be allocated. Page size 1: kept tree slots stay
    a row prefix (`drop_tree_rows`); slots of the request's own stored history that nobody else
    reaches are freed. Page size > 1: `split_tree_pages`; the copies go to new private pages put
    before the request's own, so the planner packs the kept private tokens right after them.
    """
    ps, tree = st.cfg.page_size, scheduler.tree_cache
    if ps == 1:
        tree_rows, tree_kept = row[:cpl], positions[keep[keep < cpl]]
        row, keep, new_cpl = drop_tree_rows(row, keep, cpl)
        if new_cpl < cpl and st.hit is not None:
            gone = tree_rows[~torch.isin(tree_rows, row[:new_cpl])]
            freed = tree.release_dropped(req, gone.to(st.hit[1].device))
            counters_of(scheduler).pages_freed += freed
            st.count_freed(freed)
        elif new_cpl < cpl:  # prompt positions are path indices: keep the path to the last kept one
            tree.relock_shallower(req, int(tree_kept.max()) + 1 if new_cpl else 0)
        return LeftTree(row, keep, new_cpl, row[:0], row[:0])
    split = split_tree_pages(keep, cpl, ps)
    c, w = split.copy.numel(), split.whole.numel()
    new = -(-c // ps) * ps
    slots = _alloc(scheduler, new) if new else row[:0]
    if slots is None:
        return None
    slots = slots.to(torch.int64).cpu()
    if w < cpl and st.cfg.reclaim == "vtoken":  # the copies no longer need the tree
        # Whole pages need not be a prefix (sinks, then a later run): lock up to the last one.
        # (Naive-Evict keeps its lock: see held.hold_naive_pages.)
        tree.relock_shallower(req, int(positions[split.whole].max()) + 1 if w else 0)
    view = torch.cat([row[split.whole], slots, row[cpl:]])
    priv = keep[keep >= cpl] - cpl + w + new
    return LeftTree(view, torch.cat([torch.arange(w + c), priv]), w, row[split.copy], slots[:c])


def _alloc(scheduler, n: int) -> torch.Tensor | None:
    """`n` slots (whole pages) from the pool, evicting unlocked radix-cache nodes if needed."""
    allocator = scheduler.token_to_kv_pool_allocator
    if allocator.available_size() < n:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        scheduler.tree_cache.evict(EvictParams(num_tokens=n))
    return allocator.alloc(n) if allocator.available_size() >= n else None
