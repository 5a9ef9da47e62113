"""The per-row eviction path: the oracle of the batched step (`sgl_vtoken/step.py`) and its baseline in
`scripts/bench_evict_step.py`.

One row at a time, with the plain functions the batched step vectorizes: the policy's
`keep`, `planner.drop_tree_rows` / `planner.split_tree_pages` for tree-owned victims,
`planner.plan_eviction`, one `repack_kv_` and one row write per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sgl_vtoken.kernels import repack_kv_
from sgl_vtoken.planner import drop_tree_rows, plan_eviction, split_tree_pages
from sgl_vtoken.step import EvictRow, KVPoolView, row_view


class RowResult(NamedTuple):
    """One row's eviction (host tensors): kept row indices, the freed pages (page ids), the
    KV moves, the counts of the batched step's summary."""

    keep: torch.Tensor
    new_len: int
    freed: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    whole: int
    copies: int
    depth: int


def evict_row_ref(
    r: EvictRow, pool: KVPoolView, alloc: Callable[[int], torch.Tensor | None] = lambda n: None
) -> RowResult | None:
    """Evict row `r` in place (KV moves and row rewrite; the caller frees `freed`). `alloc(n)`
    gives `n` fresh slots (whole pages) for copies of kept tree tokens; None when it cannot
    (then nothing changes and None is returned)."""
    ps, L, cpl = pool.page_size, r.length, r.cpl
    table = pool.req_to_token
    row = table[r.row, :L].to(torch.int64)
    positions = r.positions.to(row.device)
    keep = r.policy.keep(row_view(r, pool, row, positions), r.budget)
    copy_src = copy_dst = row[:0]
    w, depth = cpl, 0
    if cpl and not r.shared:
        if ps == 1:
            tree_kept = positions[keep[keep < cpl]]
            row, keep_v, w = drop_tree_rows(row, keep, cpl)
            depth = int(tree_kept.max()) + 1 if w else 0
        else:
            split = split_tree_pages(keep, cpl, ps)
            c, w = split.copy.numel(), split.whole.numel()
            new = -(-c // ps) * ps
            slots = alloc(new) if new else row[:0]
            if slots is None:
                return None
            slots = slots.to(row.device, torch.int64)
            depth = int(positions[split.whole].max()) + 1 if w else 0
            copy_src, copy_dst = row[split.copy], slots[:c]
            row = torch.cat([row[split.whole], slots, row[cpl:]])
            priv = keep[keep >= cpl] - cpl + w + new
            keep_v = torch.cat([torch.arange(w + c, device=row.device), priv])
    else:
        keep_v = keep
    plan = plan_eviction(row, keep_v, cpl=w, page_size=ps)
    src, dst = torch.cat([copy_src, plan.src]), torch.cat([copy_dst, plan.dst])
    if src.numel():
        repack_kv_(pool.k_buffers, pool.v_buffers, src, dst)
    new_row = torch.cat([row[: plan.row_start], plan.row_slots])
    table[r.row, : plan.new_len] = new_row.to(table.dtype)
    return RowResult(
        keep.cpu(),
        plan.new_len,
        plan.freed_pages.cpu(),
        src.cpu(),
        dst.cpu(),
        w,
        int(copy_src.numel()),
        depth,
    )
