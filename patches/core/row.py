"""Where a request's row entries sit in its logical sequence (`st.row`): the positions the last
eviction kept, then a constant offset (docs/design/splice.md, "Row coordinates plus a position
offset")."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class Row:
    """Where the row's entries sit in the logical sequence: entry j is at ``kept_pos[j]`` for the
    entries the last eviction kept, at ``j + offset`` after them."""

    kept_pos: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int64)
    )  # [m] int64, CPU
    offset: int = 0  # tokens evicted so far: logical - row position
    steps: int = 0  # evictions so far (seeded policies hash it)
    freed: int = 0  # pages of its KV freed so far

    def positions(self, row_len: int) -> torch.Tensor:
        """``[row_len] int64`` logical position of every live row entry."""
        m = self.kept_pos.numel()
        return torch.cat([self.kept_pos[:row_len], torch.arange(m, row_len) + self.offset])

    def record(self, kept_pos: torch.Tensor, evicted: int, pages: int) -> None:
        """An eviction left the row holding the entries at logical `kept_pos` (ascending, one per
        row entry), `evicted` tokens fewer, and returned `pages` pages to the pool."""
        self.kept_pos, self.offset = kept_pos, self.offset + evicted
        self.steps += 1
        self.freed += pages

    def count_freed(self, pages: int) -> None:
        """`pages` of the request's KV went back to the pool outside an eviction plan (its stored
        history's slots only it reached)."""
        self.freed += pages

    def start_at(self, positions: torch.Tensor, depth: int) -> None:
        """The row is a stored view whose entries sit at logical `positions` (any device) and
        cover the first `depth` logical tokens; the entries after them continue at `depth`."""
        self.kept_pos, self.offset = positions.clone().cpu(), depth - len(positions)

    def keep(self, kept_pos: torch.Tensor, dropped: int) -> None:
        """Entries left the row outside an eviction (a turn's recalled tokens, at its end): it
        holds the entries at logical `kept_pos`, `dropped` entries fewer; counts unchanged."""
        self.kept_pos, self.offset = kept_pos, self.offset + dropped

    def join(self, back: int, recalled: torch.Tensor, resume: int) -> None:
        """Recall: the row keeps its first `back` entries, then entries at logical `recalled`
        ``[n] int64``; the entries after them continue at logical position `resume`."""
        self.kept_pos = torch.cat([self.positions(back), recalled.cpu()])
        self.offset = resume - (back + recalled.numel())

    def clear(self, forget: bool) -> None:
        """The row starts over from logical position 0; `forget`: its evictions are forgotten."""
        self.kept_pos, self.offset = self.kept_pos[:0], 0
        if forget:
            self.steps = 0

    def snapshot(self) -> Row:
        """A copy of the positions and counts, for `restore` (tensors are replaced, never written
        in place)."""
        return replace(self)

    def restore(self, saved: Row) -> None:
        """Back to the positions and counts of `saved` (`snapshot`)."""
        self.kept_pos, self.offset, self.steps, self.freed = (
            saved.kept_pos,
            saved.offset,
            saved.steps,
            saved.freed,
        )
