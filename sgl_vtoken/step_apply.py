"""The apply phase of an eviction step: the decision of `step.decide` (or `step.plan_keep`)
carried out once the caller has given each row's copies their slots::

    slot_plan    where each kept entry goes (the new rows), the KV moves, the freed pages
    repack_kv_   ONE launch for every row's moves (on the caller's move stream)
    row write    ONE write of the rows' `req_to_token` entries -> Applied

Rows whose own prompt part left the tree take their copies onto that part (`pack_onto_own`).
The interval arithmetic: docs/design/library.md, "The batched step"; the per-row reference:
`tests/helpers/step_ref.py` (`tests/runtime/lib/test_step.py`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from sgl_vtoken.kernels import repack_kv_
from sgl_vtoken.step import Decision, KVPoolView, to_device
from sgl_vtoken.step_plan import IndexPlan


@dataclass
class Applied:
    """What `apply` did: `freed` page ids (device), `freed_counts[b]` of them per row, in order;
    `released`, per `onto_own` row in order, the pages (slots at page size 1) of its own part
    that its copies left empty, for the caller to free."""

    freed: torch.Tensor
    freed_counts: list[int]
    moved: int
    released: list[torch.Tensor]


def apply(
    d: Decision,
    pool: KVPoolView,
    copy_slots: list[torch.Tensor] | None = None,
    active: list[bool] | None = None,
    move_stream: AbstractContextManager[object] | None = None,
    onto_own: list[bool] | None = None,
) -> Applied:
    """Carry out the decision for the `active` rows (default all): one repack launch (on
    `move_stream` when given), one row write. `copy_slots[b]`: the fresh pages (slots, on the
    pool's device) for row b's ``counts[b].copies`` copies, whole pages; where `onto_own[b]`
    (the row's `Decision.own_copies` must hold), its own part's slots instead, that part having
    left the tree: the copies are packed onto them (`pack_onto_own`) and the pages they leave
    empty come back in `Applied.released`."""
    ps, dev = pool.page_size, pool.req_to_token.device
    rows = len(d.table_rows)
    sel = list(range(rows)) if active is None else [b for b, a in enumerate(active) if a]
    if not sel:
        return Applied(d.raw.new_zeros(0), [], 0, [])
    released = (
        [pack_onto_own(d, b, copy_slots[b], ps)[1] for b in sel if onto_own[b]]
        if onto_own is not None and copy_slots is not None
        else []
    )
    plan, raw, lengths, cpl = d.plan, d.raw, d.lengths, d.cpl
    if len(sel) < rows:
        pick = to_device(torch.tensor(sel), dev)
        plan = IndexPlan(*(t.index_select(0, pick) for t in plan))
        raw, lengths, cpl = raw[pick], lengths[pick], cpl[pick]
    c = [d.counts[b] for b in sel]
    copies = [copy_slots[b] for b in sel] if copy_slots is not None else []
    slots = (
        pad_sequence([t.to(dev, torch.int64) for t in copies], batch_first=True)
        if any(t.numel() for t in copies)
        else raw.new_zeros(len(sel), 0)
    )
    if slots.shape[1] == 0:
        slots = raw.new_zeros(len(sel), ps)
    num_moves = sum(r.copies + r.moved for r in c)
    freed_counts = [r.freed for r in c]
    sp = slot_plan(plan, raw, lengths, cpl, slots, ps, num_moves, sum(freed_counts))
    if num_moves:
        with move_stream or nullcontext():
            repack_kv_(pool.k_buffers, pool.v_buffers, sp.src, sp.dst)
    idx = to_device(torch.tensor([d.table_rows[b] for b in sel], dtype=torch.int64), dev)
    w = raw.shape[1]
    pool.req_to_token[idx[:, None], torch.arange(w, device=dev)] = sp.new_rows.to(
        pool.req_to_token.dtype
    )
    return Applied(sp.freed, freed_counts, num_moves, released)


def pack_onto_own(
    d: Decision, b: int, own: torch.Tensor, ps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `b`'s copies on its own part's slots instead of fresh pages, when that part has left
    the tree (`Decision.own_copies` must hold): the k-th copy goes to ``own[k]``, which the
    repack's in-place order allows (every copy moves to or before its source)::

        row   | whole | own: k0 .  k1 k2 | .  .  k3 . | .  .  .  . | private ...
        after | whole | k0 k1 k2 k3      | (free)     | (free)     | private ...

    Args:
        own: ``[cpl - own_from] int64`` the slots of the row's entries ``own_from:cpl``, whole
            pages, in row order.
    Returns:
        ``(copy_slots, free)``: `apply`'s `copy_slots` for row `b`, and the pages of `own` the
        copies leave empty (slots at page size 1), for the caller to free.
    """
    used = -(-d.counts[b].copies // ps)  # pages the copies fill (the last one with privates)
    return own, own[used * ps :: ps] // ps


class SlotPlan(NamedTuple):
    """Slot half of a batched plan (device tensors)."""

    new_rows: torch.Tensor  # [B, W] int64: row entries after the step (beyond new_len: unchanged)
    src: torch.Tensor  # [moves] int64: KV moves kv[dst] = kv[src], row by row, row order
    dst: torch.Tensor
    freed: torch.Tensor  # [pages] int64 page ids (slots at page size 1), row by row


def slot_plan(
    ip: IndexPlan,
    raw: torch.Tensor,
    lengths: torch.Tensor,
    cpl: torch.Tensor,
    copy_slots: torch.Tensor,
    ps: int,
    num_moves: int,
    num_freed: int,
) -> SlotPlan:
    """The slots of `ip`: `raw` ``[B, W]`` is each row's slots (padding: any valid slot),
    `copy_slots` ``[B, C]`` the fresh pages of each row's copies (C >= 1, whole pages, padded),
    `num_moves` / `num_freed` the totals of the summary's ``copies + moved`` / ``freed``."""
    b, w = raw.shape
    j = torch.arange(w, device=raw.device)
    nw, nc, npriv = ip.summary[:, 0:1], ip.summary[:, 1:2], ip.summary[:, 2:3]
    nnew = (nc + ps - 1) // ps
    page_ids = raw[:, ::ps] // ps  # [B, P]
    p = page_ids.shape[1]
    live_ids = raw.new_zeros(b, p + 1)  # column p: dummy
    live_ids.scatter_(1, torch.where(ip.live, ip.rank, p), page_ids)
    fresh = copy_slots[:, ::ps] // ps  # [B, C / ps]
    k = nc + ip.kept_priv.cumsum(1) - 1  # offset in live list
    r = k // ps
    page = torch.where(
        r >= nnew,
        live_ids.gather(1, (r - nnew).clamp(0, p - 1)),
        fresh.gather(1, r.clamp(0, fresh.shape[1] - 1)),
    )
    priv_slot = page * ps + k % ps
    copy_dst = copy_slots.gather(1, (ip.copy.cumsum(1) - 1).clamp(0, copy_slots.shape[1] - 1))
    t = torch.where(
        ip.whole,
        ip.whole.cumsum(1) - 1,
        torch.where(ip.copy, nw + ip.copy.cumsum(1) - 1, torch.where(ip.kept_priv, k + nw, w)),
    )
    val = torch.where(ip.whole, raw, torch.where(ip.copy, copy_dst, priv_slot))
    new_rows = raw.new_zeros(b, w + 1).scatter_(1, t, val)[:, :w]
    new_rows = torch.where(j < (nw + nc + npriv), new_rows, raw)
    moves = torch.nonzero_static((ip.copy | ip.moved).flatten(), size=num_moves).flatten()
    dst = torch.where(ip.copy, copy_dst, priv_slot).flatten()[moves]
    pidx = torch.arange(p, device=raw.device)
    kept_pages = (nc + npriv + ps - 1) // ps - nnew
    private_page = (pidx >= (cpl // ps)[:, None]) & (pidx < ((lengths + ps - 1) // ps)[:, None])
    dead = private_page & ~(ip.live & (ip.rank < kept_pages))
    freed = page_ids.flatten()[torch.nonzero_static(dead.flatten(), size=num_freed).flatten()]
    return SlotPlan(new_rows, raw.flatten()[moves], dst, freed)
