"""The per-row eviction path: the reference of the batched step (`sgl_vtoken/step.py`,
`sgl_vtoken/step_plan.py`), which `tests/runtime/lib/test_step.py` holds equal to it.

One row at a time: the policy's `keep` (a batch of one of the step's selection), then the
per-row repack planner: `drop_tree_rows` / `split_tree_pages` for tree-owned victims,
`plan_eviction` for the private part (docs/design/library.md "The repack planner"), one `repack_kv_`
and one row write per row (`evict_row_ref`). The planner's property tests drive `plan_eviction`
through `RequestRow` (`helpers.row`), naive reclaim included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sgl_vtoken.config import RECLAIM_MODES
from sgl_vtoken.kernels import repack_kv_
from sgl_vtoken.pages import row_pages
from sgl_vtoken.step import EvictRow, KVPoolView, row_view


@dataclass(frozen=True)
class RepackPlan:
    """What the server does after an eviction (all tensors int64, on the row's device).

    Attributes:
        src, dst: ``[m]`` KV moves ``kv[dst] = kv[src]`` for every layer, K and V (row order).
        row_start: first row position whose slot entry changes (``new_len`` if none).
        row_slots: ``[new_len - row_start]`` slot entries of row positions
            ``[row_start, new_len)``.
        old_len, new_len: row length before and after.
        freed_pages: ``[p]`` page ids to free (at page size 1, page id == slot).
        page_size: the pool's page size.
        dense: the row stays page-dense (always for vtoken; naive rows keep holes at ps > 1).
    """

    src: torch.Tensor
    dst: torch.Tensor
    row_start: int
    row_slots: torch.Tensor
    old_len: int
    new_len: int
    freed_pages: torch.Tensor
    page_size: int
    dense: bool

    @property
    def num_moved(self) -> int:
        return int(self.src.numel())

    @property
    def num_freed_pages(self) -> int:
        return int(self.freed_pages.numel())

    @property
    def freed_slots(self) -> torch.Tensor:
        """``[p * page_size]`` every slot of the freed pages."""
        ps = self.page_size
        offs = torch.arange(ps, device=self.freed_pages.device)
        return (self.freed_pages.unsqueeze(1) * ps + offs).reshape(-1)

    @property
    def num_evicted(self) -> int:
        return self.old_len - self.new_len


def plan_eviction(
    row: torch.Tensor,
    keep: torch.Tensor,
    *,
    cpl: int = 0,
    page_size: int = 1,
    reclaim: str = "vtoken",
    shift_dead_pages: bool = True,
) -> RepackPlan:
    """Plan the reclamation of one request's row after its policy chose `keep` (the batched
    step's `step_plan` is this arithmetic for every row at once, vtoken reclaim only)::

        held pages  P0 [a . b .] P1 [. . . .] P2 [c d e f] P3 [g h]      "." evicted
        shift       P0 [a . b .] P2 [c d e f] P3 [g h]                   P1 freed, no move
        compact     P0 [a b c d] P2 [e f g h]                            moves dst <= src
        result      row[cpl:cpl+8] = P0 P2 slots, len = cpl + 8, freed P1, P3 (the tail)

    naive: same victims, no moves; the row keeps only the live slots and a page is freed only
    when none of its tokens is live (the row is then not dense at page size > 1). Moves are in
    row order and may overwrite the source of an earlier move, never of a later one.

    Args:
        row: ``[L] int64`` slot of each live row position (``req_to_token[row_idx, :L]``).
        keep: ascending, unique row indices to keep; must include every row ``< cpl``.
        cpl: tree-owned prefix length (``cache_protected_len``); page-aligned when ps > 1.
        page_size: pool page size.
        reclaim: ``"vtoken"`` (compact and free) or ``"naive"`` (free fully dead pages only).
        shift_dead_pages: vtoken only; drop pages without kept tokens by a row shift before
            compacting (fewer moves). False gives splice rule 6 exactly (row entries unchanged).

    Raises:
        ValueError: bad `keep`, a dropped tree-owned row, a misaligned `cpl`, unknown `reclaim`.
    """
    if reclaim not in RECLAIM_MODES:
        raise ValueError(f"reclaim must be one of {list(RECLAIM_MODES)} (got {reclaim!r})")
    row, keep = row.to(torch.int64), keep.to(torch.int64)
    L, ps = row.numel(), page_size
    _check_keep(keep, L, cpl, ps)
    priv = keep[keep >= cpl]  # [n] kept private row positions
    n = priv.numel()
    pages = row_pages(row[cpl:], ps)  # [P] held private pages, in order
    sorted_pages, perm = pages.sort()
    slot_page = perm[torch.searchsorted(sorted_pages, row[priv] // ps)]  # [n] index into pages
    live = torch.zeros(pages.numel(), dtype=torch.bool, device=row.device)
    live[slot_page] = True
    empty = row.new_zeros(0)
    if reclaim == "naive":
        keep_page = live
        new_private, src, dst = row[priv], empty, empty
    else:
        order = (
            live.nonzero().flatten()
            if shift_dead_pages
            else torch.arange(pages.numel(), device=row.device)
        )  # page list after the shift
        shifted = torch.full_like(live, -1, dtype=torch.int64)
        shifted[order] = torch.arange(order.numel(), device=row.device)
        k = torch.arange(n, device=row.device)
        o = shifted[slot_page] * ps + row[priv] % ps  # [n] offset in the page list
        new_private = pages[order[k // ps]] * ps + k % ps  # slot of offset k
        moved = o != k
        src, dst = row[priv][moved], new_private[moved]
        keep_page = torch.zeros_like(live)
        keep_page[order[: -(-n // ps)]] = True
    old_private = row[cpl : cpl + n]
    diff = (new_private != old_private).nonzero()
    first = int(diff[0]) if diff.numel() else n
    return RepackPlan(
        src=src,
        dst=dst,
        row_start=cpl + first,
        row_slots=new_private[first:],
        old_len=L,
        new_len=cpl + n,
        freed_pages=pages[~keep_page],
        page_size=ps,
        dense=reclaim == "vtoken" or ps == 1,
    )


def _check_keep(keep: torch.Tensor, L: int, cpl: int, ps: int) -> None:
    if not 0 <= cpl <= L:
        raise ValueError(f"cpl must be in [0, {L}] (got {cpl})")
    if ps > 1 and cpl % ps:
        raise ValueError(f"cpl must be a multiple of page_size={ps} (got {cpl})")
    if keep.dim() != 1:
        raise ValueError(f"keep must be 1-D (got shape {tuple(keep.shape)})")
    if keep.numel():
        if int(keep[0]) < 0 or int(keep[-1]) >= L:
            raise ValueError(f"keep indices must be in [0, {L})")
        if keep.numel() > 1 and not bool((keep[1:] > keep[:-1]).all()):
            raise ValueError("keep indices must be strictly ascending")
    if int((keep < cpl).sum()) != cpl:
        raise ValueError(
            f"keep must include every tree-owned row [0, {cpl}): a request may not "
            f"free or move slots it does not own"
        )


def drop_tree_rows(
    row: torch.Tensor, keep: torch.Tensor, cpl: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Drop tree-owned victims from a row's view before planning (page size 1 only).

    Tree-owned slots are never freed by the request (the radix tree owns them): a tree-owned
    victim only leaves the row. The kept tree-owned slots stay a prefix of the row::

        row   | t0 t1 t2 t3 | p0 p1 p2 |    keep = {t0, t2, p0, p2}, cpl = 4
        view  | t0 t2 | p0 p1 p2 |         cpl' = 2, keep' = {0, 1, 2, 4}

    Returns ``(row', keep', cpl')`` for :func:`plan_eviction`, whose plan then covers the
    private part; the caller writes ``row'[:cpl']`` into the row when ``cpl' < cpl``.
    """
    tree_keep = keep[keep < cpl]
    new_cpl = int(tree_keep.numel())
    view = torch.cat([row[tree_keep], row[cpl:]])
    priv = keep[keep >= cpl] - cpl + new_cpl
    return (
        view,
        torch.cat([torch.arange(new_cpl, device=keep.device, dtype=keep.dtype), priv]),
        new_cpl,
    )


@dataclass(frozen=True)
class TreeSplit:
    """How a page-dense row (page size > 1) stops using tree-owned tokens it evicted.

    Attributes:
        whole: ``[w * page_size]`` row indices of tree pages the row keeps referencing: fully
            kept pages before the first partially kept one. They stay the row's prefix.
        copy: ``[c]`` row indices of the other kept tree-owned tokens, in row order: they are
            copied (copy-on-write) to the head of the request's private pages.
        dropped: tree-owned row entries that leave the view (never freed by the request).
    """

    whole: torch.Tensor
    copy: torch.Tensor
    dropped: int


def split_tree_pages(
    keep: torch.Tensor, cpl: int, page_size: int, own_from: int | None = None
) -> TreeSplit:
    """Split the kept tree-owned rows ``keep[keep < cpl]`` into whole pages and copies; from
    the page of row `own_from` on every kept one is copied (the request's own prompt).

    A shared page is never written, and a page-dense row cannot reference part of a page::

        tree pages  T0 [a b c d]  T1 [. . . .]  T2 [. f g .]  T3 [h i j k] | private ...
        keep        a b c d        (none)        f g           h i j k
        whole       T0                           first partial page: T2, so T3 is copied too
        copy        f g h i j k  -> the head of the private pages, then the kept private tokens
        dropped     T1's 4 + T2's 2 = 6 entries leave the view
    """
    ps = page_size
    if cpl % ps:
        raise ValueError(f"cpl must be a multiple of page_size={ps} (got {cpl})")
    tree_keep = keep[keep < cpl]
    counts = torch.bincount(tree_keep // ps, minlength=cpl // ps)
    partial = ((counts > 0) & (counts < ps)).nonzero().flatten()
    first_partial = int(partial[0]) if partial.numel() else cpl // ps
    if own_from is not None:
        first_partial = min(first_partial, own_from // ps)
    full = (counts == ps).nonzero().flatten()
    full = full[full < first_partial]
    whole = (full[:, None] * ps + torch.arange(ps, device=keep.device)).flatten()
    copy = tree_keep[tree_keep >= first_partial * ps]
    return TreeSplit(whole=whole, copy=copy, dropped=cpl - whole.numel() - copy.numel())


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
        if ps == 1 and r.own_from is None:
            tree_kept = positions[keep[keep < cpl]]
            row, keep_v, w = drop_tree_rows(row, keep, cpl)
            depth = int(tree_kept.max()) + 1 if w else 0
        else:
            split = split_tree_pages(keep, cpl, ps, r.own_from)
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
