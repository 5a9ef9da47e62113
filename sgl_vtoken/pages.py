"""Page accounting: a paged slot allocator with SGLang's semantics, and row page arithmetic.

Slots and pages (SGLang ``PagedTokenToKVPoolAllocator``): page 0 is the padding sink, pages
``1..num_pages`` are allocatable, ``slot = page * page_size + offset``. A request's private
region is *dense* when every row page lives in one physical page at matching offsets::

    row positions  [cpl ........................................ len)
    row pages      | page a (ps slots) | page b (ps slots) | page c (partial tail) |
    slot(p) % ps == (p - cpl) % ps, cpl % ps == 0; the allocator's next slot is slot(len-1) + 1
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed by `num_tokens` dense tokens: ``ceil(num_tokens / page_size)``."""
    return -(-num_tokens // page_size)


def row_pages(slots: torch.Tensor, page_size: int, cursor: int | None = None) -> torch.Tensor:
    """``[P] int64`` pages holding `slots` (a row region in allocation order), first-seen order.

    `cursor` (the last allocated slot) adds its page when it is not already last: a page whose
    tokens all died but that still has unused slots stays held for the next allocation.
    """
    pages = torch.unique_consecutive(slots.to(torch.int64) // page_size)
    if cursor is not None and (pages.numel() == 0 or int(pages[-1]) != cursor // page_size):
        pages = torch.cat([pages, pages.new_tensor([cursor // page_size])])
    return pages


def is_dense(slots: torch.Tensor, page_size: int) -> bool:
    """True when a page-aligned region's slots fill pages in order (entry i at offset i % ps of
    its page i // ps)."""
    n = slots.numel()
    if n == 0:
        return True
    idx = torch.arange(n, device=slots.device)
    first = slots[idx - idx % page_size]
    return bool(
        ((slots % page_size == idx % page_size) & (slots // page_size == first // page_size)).all()
    )


def page_utilization(
    live_slots: torch.Tensor, page_size: int, held_pages: torch.Tensor | None = None
) -> torch.Tensor:
    """``[P] float64`` fraction of each held page's slots that hold a live token.

    `held_pages` defaults to the pages of `live_slots`; pass it to count fully dead held pages.
    """
    pages = live_slots.to(torch.int64) // page_size
    held = torch.unique(pages) if held_pages is None else torch.unique(held_pages.to(torch.int64))
    counts = (pages.unsqueeze(1) == held.unsqueeze(0)).sum(0) if held.numel() else held
    return counts.to(torch.float64) / page_size


def fragmentation(
    live_slots: torch.Tensor, page_size: int, held_pages: torch.Tensor | None = None
) -> float:
    """The paper's intra-page waste ``F = 1 - mean_i(u_i)`` over held pages (0 when none)."""
    u = page_utilization(live_slots, page_size, held_pages)
    return 0.0 if u.numel() == 0 else float(1.0 - u.mean())


class PageAllocator:
    """Pool of `num_pages` allocatable pages (ids ``1..num_pages``; page 0 is padding).

    Pages are handed out lowest-first and freed pages go to the back of the queue, so ids are
    deterministic. "Can I?" queries (:meth:`can_alloc`) are separate from mutations.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1 (got {num_pages}, {page_size})")
        self.num_pages, self.page_size = num_pages, page_size
        self._free: deque[int] = deque(range(1, num_pages + 1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def used_pages(self) -> frozenset[int]:
        return frozenset(self._used)

    @property
    def num_slots(self) -> int:
        """Size of a KV buffer for this pool, padding page included."""
        return (self.num_pages + 1) * self.page_size

    def can_alloc(self, count: int) -> bool:
        return count <= len(self._free)

    def alloc(self, count: int) -> list[int]:
        """`count` fresh page ids. Raises MemoryError when the pool cannot supply them."""
        if not self.can_alloc(count):
            raise MemoryError(f"need {count} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: torch.Tensor | Iterable[int]) -> None:
        """Return pages to the pool. Raises ValueError on a page that is not allocated."""
        pages = [int(p) for p in (pages.tolist() if torch.is_tensor(pages) else pages)]
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages not allocated (or twice): {bad or pages}")
        self._used.difference_update(pages)
        self._free.extend(sorted(pages))

    def append_slots(self, cursor: int | None, count: int) -> list[int]:
        """Slots for `count` new tokens after `cursor` (the last allocated slot, or None): the
        rest of the cursor's page first, then fresh pages (SGLang ``alloc_extend`` order)."""
        ps, out = self.page_size, []
        if cursor is not None and (cursor + 1) % ps:
            room = ps - (cursor + 1) % ps
            out = list(range(cursor + 1, cursor + 1 + min(room, count)))
        for page in self.alloc(num_pages(count - len(out), ps)):
            out.extend(range(page * ps, page * ps + ps))
        return out[:count]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert not (free & self._used), f"pages both free and used: {sorted(free & self._used)}"
        assert free | self._used == set(range(1, self.num_pages + 1)), "pages lost or invented"
