"""Selection: which entries of each row an eviction keeps, one rule for every caller.

Kept: every must-keep entry (:func:`must_keep`: sinks, recent window, and the caller's shared
prefix and pinned entries), then the best scores up to `budget`; ties keep the later entry, NaN
ranks last. With units (span-aware keeping, `sgl_vtoken.units`), an entry scores as its unit's
best entry, and a unit kept in part loses its entries that are not must-keep: a number or a
word is kept whole or not at all (the row may then keep fewer than `budget`). Rows are
lines of ``[B, W]`` tensors, each row's ``lengths[b]`` live entries first, then padding. One row
is a batch of one (:meth:`EvictionPolicy.keep`, :func:`ranking`, :func:`top_budget`); the
server's step selects all its rows at once. Nothing here waits for the device: the budget check
(:func:`check_budget`) reads :attr:`Selection.over` on the host, when the caller has it there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch


def rank_rows(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, W] int64``: each row's entries from the best score down, its live entries first.

    Ties: the later entry first (each row's live part is reversed, padding stays after it, then
    sorted stably); NaN and padding rank last."""
    b, w = scores.shape
    j = torch.arange(w, device=scores.device).expand(b, w)
    live = j < lengths[:, None]
    s = torch.nan_to_num(scores.to(torch.float64), nan=-math.inf).masked_fill(~live, -math.inf)
    flip = torch.where(live, lengths[:, None] - 1 - j, j)
    order = s.gather(1, flip).sort(dim=1, descending=True, stable=True).indices
    return flip.gather(1, order)


def top_rows(scores: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B, W] bool``: the ``k[b]`` best live entries of each row (:func:`rank_rows` order);
    ``k[b] <= lengths[b]``."""
    b, w = scores.shape
    j = torch.arange(w, device=scores.device).expand(b, w)
    keep = torch.zeros(b, w, dtype=torch.bool, device=scores.device)
    return keep.scatter_(1, rank_rows(scores, lengths), j < k[:, None])


def must_keep(
    positions: torch.Tensor,
    lengths: torch.Tensor,
    sink: torch.Tensor,
    window: torch.Tensor,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, W] bool``: the live entries kept whatever their score: sinks (``positions <
    sink[b]``), the last ``window[b]`` live entries, and `extra` ``[B, W] bool`` (the shared
    prefix, pinned entries). ``positions [B, W]``, ``lengths, sink, window [B]`` int64."""
    j = torch.arange(positions.shape[1], device=positions.device)
    must = (positions < sink[:, None]) | (j >= (lengths - window)[:, None])
    if extra is not None:
        must = must | extra
    return must & (j < lengths[:, None])


class Selection(NamedTuple):
    """What :func:`select` chose (on the scores' device)."""

    keep: torch.Tensor  # [B, W] bool: kept entries (False on padding)
    over: torch.Tensor  # [B] int64: must-keep entries beyond the budget (> 0: budget too small)


def select(
    scores: torch.Tensor,
    must: torch.Tensor,
    budget: torch.Tensor,
    lengths: torch.Tensor,
    units: torch.Tensor | None = None,
) -> Selection:
    """Keep ``min(budget[b], lengths[b])`` entries of each row: every `must` entry, then the best
    `scores`. ``scores [B, W]`` float, ``must [B, W]`` bool (padding ignored), ``budget,
    lengths [B]`` int64. A row whose `must` entries outnumber its budget keeps an arbitrary part
    of them: check :attr:`Selection.over` (:func:`check_budget`) before using it.

    `units` ``[B, W] int64`` (each entry's unit, :func:`unit_ids`; None: every entry its own
    unit): scores are pooled to each unit's best (:func:`unit_best`) and units kept in part
    lose their entries that are not `must` (:func:`whole_units`), so a row keeps at most
    ``min(budget[b], lengths[b])``."""
    b, w = scores.shape
    live = torch.arange(w, device=scores.device) < lengths[:, None]
    must = must & live
    ids = None if units is None else unit_ids(units, live)
    if ids is not None:
        scores = unit_best(scores, ids, live)
    s = scores.to(torch.float64).masked_fill(must, math.inf)
    keep = top_rows(s, lengths, torch.minimum(budget, lengths))
    if ids is not None:
        keep = whole_units(keep, must, ids, live)
    return Selection(keep, must.sum(1) - budget)


def unit_ids(units: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[B, W] int64`` flat unit ids: equal for the live entries of one unit of one row (its
    entries need not be neighbours: a row holds recalled entries after the rest), unique across
    rows, padding apart from every live entry. `units` ``[B, W]``: each entry's unit
    (`sgl_vtoken.units.Words.unit_starts` of the entries' positions, >= 0). A sort per row, no
    host synchronization."""
    b, w = units.shape
    u = units.masked_fill(~live, -1)
    ordered, order = u.sort(dim=1, stable=True)
    first = torch.ones_like(live)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    base = torch.arange(b, device=units.device)[:, None] * w
    dense = first.to(torch.int64).cumsum(1) - 1 + base
    return torch.empty_like(dense).scatter_(1, order, dense)


def unit_best(scores: torch.Tensor, ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``[B, W] float64``: each live entry's score replaced by its unit's best (NaN ranks as
    -inf); `ids` from :func:`unit_ids`."""
    s = torch.nan_to_num(scores.to(torch.float64), nan=-math.inf).masked_fill(~live, -math.inf)
    best = torch.full((s.numel(),), -math.inf, dtype=s.dtype, device=s.device)
    best.scatter_reduce_(0, ids.flatten(), s.flatten(), "amax")
    return torch.where(live, best[ids], scores.to(torch.float64))


def whole_units(
    keep: torch.Tensor, must: torch.Tensor, ids: torch.Tensor, live: torch.Tensor
) -> torch.Tensor:
    """``[B, W] bool``: `keep` without the entries that are not `must` of units it keeps in part::

    unit     | 3 3 3 | 6 6 6 6 | 10 |        kept in part: its free entries go
    keep     | 1 1 1 | 0 1 1 1 |  1 |   ->   | 1 1 1 | 0 0 0 0 | 1 |
    """
    n = ids.numel()
    kept = torch.zeros(n, dtype=torch.int64, device=ids.device)
    size = torch.zeros_like(kept)
    kept.scatter_add_(0, ids.flatten(), (keep & live).to(torch.int64).flatten())
    size.scatter_add_(0, ids.flatten(), live.to(torch.int64).flatten())
    part = (kept > 0) & (kept < size)
    return keep & ~(part[ids] & ~must)


def check_budget(over: Sequence[int], budgets: Sequence[int], names: Sequence[str]) -> None:
    """Raise for the first row whose must-keep entries outnumber its budget (host values).

    Raises:
        ValueError: naming that row's budget, must-keep count and policy.
    """
    for over_b, budget, name in zip(over, budgets, names):
        if over_b > 0:
            raise ValueError(
                f"budget {budget} is smaller than the {budget + over_b} tokens policy "
                f"{name!r} must keep (sinks, window, shared, pinned)"
            )


def ranking(scores: torch.Tensor) -> torch.Tensor:
    """``[n]`` indices of `scores` ``[n]`` from the highest down (:func:`rank_rows` of one row)."""
    n = scores.shape[0]
    return rank_rows(scores[None], torch.full((1,), n, device=scores.device))[0]


def top_budget(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Ascending indices of the `budget` highest of `scores` ``[n]`` (:func:`rank_rows` order)."""
    return ranking(scores)[:budget].sort().values
