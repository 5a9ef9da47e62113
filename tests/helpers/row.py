"""RequestRow: one request's token table (row slots, positions, ownership, allocation cursor).

The CPU twin of a ``req_to_token`` row plus the per-request state the server keeps beside it;
the planner's property tests drive it through appends and evictions::

    slots      | tree-owned [0, cpl) | private [cpl, len)             |
    positions  | 0 .. cpl-1          | ascending, with gaps where evicted |
    cursor     last allocated slot: the next token goes to cursor + 1 unless its page is full
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helpers.reference import apply_plan_ref
from helpers.step_ref import RepackPlan, plan_eviction
from sgl_vtoken.pages import PageAllocator, is_dense, num_pages, row_pages


class RequestRow:
    """Args:
    allocator: the pool the private pages come from.
    tree_slots: ``[cpl] int64`` slots of the tree-owned prefix (not allocated by this row).
    """

    def __init__(self, allocator: PageAllocator, tree_slots: torch.Tensor | None = None) -> None:
        self.allocator, self.page_size = allocator, allocator.page_size
        self.slots = torch.zeros(0, dtype=torch.int64) if tree_slots is None else tree_slots.long()
        self.cpl = self.slots.numel()
        self.positions = torch.arange(self.cpl, dtype=torch.int64)
        self.cursor: int | None = None
        self.next_pos = self.cpl

    def __len__(self) -> int:
        return self.slots.numel()

    @property
    def num_private(self) -> int:
        return len(self) - self.cpl

    def held_pages(self) -> torch.Tensor:
        """``[P]`` private pages held, in allocation order."""
        return row_pages(self.slots[self.cpl :], self.page_size, self.cursor)

    def append(self, count: int) -> torch.Tensor:
        """Allocate and append `count` new tokens; returns their ``[count]`` slots."""
        new = torch.tensor(self.allocator.append_slots(self.cursor, count), dtype=torch.int64)
        if count:
            self.cursor = int(new[-1])
        self.slots = torch.cat([self.slots, new])
        self.positions = torch.cat(
            [self.positions, torch.arange(self.next_pos, self.next_pos + count)]
        )
        self.next_pos += count
        return new

    def plan(
        self, keep: torch.Tensor, reclaim: str = "vtoken", shift_dead_pages: bool = True
    ) -> RepackPlan:
        return plan_eviction(
            self.slots,
            keep,
            cpl=self.cpl,
            page_size=self.page_size,
            reclaim=reclaim,
            shift_dead_pages=shift_dead_pages,
        )

    def apply(
        self, plan: RepackPlan, keep: torch.Tensor, buffers: Sequence[torch.Tensor] = ()
    ) -> None:
        """Apply `plan` (made from `keep`) to the buffers, this row and the allocator."""
        apply_plan_ref(plan, buffers, self.slots, self.allocator)
        self.slots = self.slots[: plan.new_len].clone()
        self.positions = self.positions[keep]
        freed = set(plan.freed_pages.tolist())
        if plan.dense:
            self.cursor = int(self.slots[-1]) if self.num_private else None
        elif self.cursor is not None and self.cursor // self.page_size in freed:
            self.cursor = None

    def check_integrity(self) -> None:
        """Row invariants: unique slots, ascending positions, dense vtoken rows, owned pages."""
        assert self.slots.numel() == self.positions.numel(), "slots and positions disagree"
        assert torch.unique(self.slots).numel() == self.slots.numel(), "a slot is mapped twice"
        if len(self) > 1:
            assert bool((self.positions[1:] > self.positions[:-1]).all()), "positions not ascending"
        held = self.held_pages()
        assert num_pages(self.num_private, self.page_size) <= held.numel(), "too few pages held"
        assert set(held.tolist()) <= self.allocator.used_pages, (
            "row holds a page the allocator thinks is free"
        )


def is_dense_row(row: RequestRow) -> bool:
    """True when the private region is page-dense (always after a vtoken plan)."""
    return is_dense(row.slots[row.cpl :], row.page_size)
