"""Old names, kept until patches/ import their new homes (then this module goes).

`RECLAIM_MODES` lives in `sgl_vtoken.config`. The per-row planner (`plan_eviction`,
`RepackPlan`) is the batched step's reference in `sgl_vtoken_tools/step_ref.py`; the runtime
plans through the step (`sgl_vtoken.step.plan_keep` for keep masks a caller chose). This
`plan_eviction` is that call for one row, shaped as the old plan for
`patches/cache/host_recall.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_vtoken.config import RECLAIM_MODES
from sgl_vtoken.step import KVPoolView, plan_keep
from sgl_vtoken.step_plan import slot_plan

__all__ = ["RECLAIM_MODES", "RowPlan", "plan_eviction"]


class RowPlan(NamedTuple):
    """One row's plan: KV moves ``kv[dst] = kv[src]``, the row entries ``[row_start,
    new_len)``, the freed page ids (slots at page size 1)."""

    src: torch.Tensor
    dst: torch.Tensor
    row_start: int
    row_slots: torch.Tensor
    new_len: int
    freed_pages: torch.Tensor

    @property
    def num_moved(self) -> int:
        return int(self.src.numel())

    @property
    def num_freed_pages(self) -> int:
        return int(self.freed_pages.numel())


def plan_eviction(
    row: torch.Tensor, keep: torch.Tensor, *, cpl: int = 0, page_size: int = 1
) -> RowPlan:
    """The plan of keeping the entries `keep` (ascending indices, every one ``< cpl`` among
    them) of the page-dense `row` ``[L]``: `plan_keep` on a one-row table of `row`."""
    ps, n = page_size, row.numel()
    table = row.to(torch.int64)[None].clone()
    mask = torch.zeros(n, dtype=torch.bool, device=row.device)
    mask[keep.to(row.device)] = True
    d = plan_keep(KVPoolView(table, [], [], ps), [0], [mask], [cpl])
    c = d.counts[0]
    copies = d.raw.new_zeros(1, ps)
    sp = slot_plan(d.plan, d.raw, d.lengths, d.cpl, copies, ps, c.copies + c.moved, c.freed)
    new = sp.new_rows[0, : c.new_length]
    diff = (new != table[0, : c.new_length]).nonzero()
    start = int(diff[0]) if diff.numel() else c.new_length
    return RowPlan(sp.src, sp.dst, start, new[start:], c.new_length, sp.freed)
