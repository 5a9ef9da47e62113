"""The repack planner: where each row's kept entries go and which pages come free, for every
row of an eviction step at once, on ``[B, W]`` tensors (W the longest row), with no host
synchronization. :func:`index_plan` needs only the keep masks (whole versus copied tree-owned
entries, which kept private tokens move, the per-row counts the host reads once);
:func:`step_apply.slot_plan` adds the slots once the host has allocated the copies' pages (the
new rows, the KV moves, the freed pages). The interval arithmetic: docs/design/library.md, "The
batched step"; its per-row reference: `tests/helpers/step_ref.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowCounts(NamedTuple):
    """One row's plan in numbers (host ints): a row of :attr:`IndexPlan.summary`."""

    whole: int  # kept tree-owned entries still referenced in place (whole pages)
    copies: int  # kept tree-owned entries copied to fresh private pages
    kept_private: int  # kept private entries
    moved: int  # kept private entries whose KV moves
    depth: int  # logical depth of the tree-owned part the row still references
    freed: int  # pages freed (slots at page size 1)

    @property
    def new_length(self) -> int:
        """Live row entries after the step."""
        return self.whole + self.copies + self.kept_private


class IndexPlan(NamedTuple):
    """Slot-independent half of a batched plan (device tensors, ``[B, W]`` unless noted)."""

    whole: torch.Tensor  # bool: kept tree rows the row keeps referencing (whole pages)
    copy: torch.Tensor  # bool: kept tree rows copied to fresh private pages
    kept_priv: torch.Tensor  # bool: kept private rows
    moved: torch.Tensor  # bool: kept private rows whose KV moves
    live: torch.Tensor  # [B, P] bool: private row pages holding a kept token
    rank: torch.Tensor  # [B, P] int64: rank of each live private page among them
    summary: torch.Tensor  # [B, 6] int64, the columns of RowCounts


def _pages(mask: torch.Tensor, ps: int) -> torch.Tensor:
    """``[B, W]`` bool -> ``[B, ceil(W / ps)]`` int64 count of set entries per row page."""
    b, w = mask.shape
    p = -(-w // ps)
    padded = mask.new_zeros(b, p * ps, dtype=torch.int64)
    padded[:, :w] = mask
    return padded.view(b, p, ps).sum(-1)


def index_plan(
    keep: torch.Tensor,
    lengths: torch.Tensor,
    cpl: torch.Tensor,
    positions: torch.Tensor,
    ps: int,
    own_from: torch.Tensor | None = None,
) -> IndexPlan:
    """Plan every row's eviction from its keep mask (no slot values needed).

    Args:
        keep: ``[B, W] bool`` kept row entries (False on padding).
        lengths, cpl: ``[B] int64`` row length and tree-owned prefix (page-aligned when ps > 1).
        positions: ``[B, W] int64`` logical positions (`depth` is the last whole one + 1).
        ps: page size.
        own_from: ``[B] int64`` row index from whose page on kept tree-owned entries are copied
            even from whole pages (None: `cpl`, only partly kept pages are copied).
    """
    b, w = keep.shape
    j = torch.arange(w, device=keep.device)
    page_of = (j // ps).expand(b, w)
    tree = j < cpl[:, None]
    kt, kp = keep & tree, keep & ~tree & (j < lengths[:, None])
    counts = _pages(kt, ps)
    tree_pages = cpl // ps
    pidx = torch.arange(counts.shape[1], device=keep.device)
    partial = (pidx < tree_pages[:, None]) & (counts > 0) & (counts < ps)
    first_partial = torch.where(partial.any(1), partial.to(torch.int32).argmax(1), tree_pages)
    if own_from is not None:
        first_partial = torch.minimum(first_partial, own_from // ps)
    whole = kt & (page_of < first_partial[:, None])
    copy = kt & ~whole
    nw, nc, npriv = whole.sum(1), copy.sum(1), kp.sum(1)
    nnew = (nc + ps - 1) // ps
    live = _pages(kp, ps) > 0
    rank = live.cumsum(1) - 1
    i = kp.cumsum(1) - 1
    o = rank.gather(1, page_of) * ps + j % ps
    moved = kp & ((nnew * ps - nc)[:, None] + o != i)
    depth = torch.where(whole, positions, -1).amax(1) + 1 if w else nw
    row_pages = (lengths + ps - 1) // ps - tree_pages
    freed = row_pages - ((nc + npriv + ps - 1) // ps - nnew)
    summary = torch.stack([nw, nc, npriv, moved.sum(1), depth, freed], dim=1)
    return IndexPlan(whole, copy, kp, moved, live, rank, summary)
