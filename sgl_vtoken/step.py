"""One eviction pass per scheduler step: every row that reached its trigger at once.

No SGLang here: the step reads an SGLang-shaped pool (:class:`KVPoolView`) and rows described by
the caller (:class:`EvictRow`), so the same code runs in the server (`patches/step/eviction.py`)
and in the tests on fake pools (`tests/runtime/lib/test_step.py`). Two calls, with the caller's tree
work between::

    decide(rows, pool)       scores -> keep (`selection.select`) -> index plan (`step_plan`), on
                             the pool's device; ONE host copy (keep masks, counts) -> Decision
    plan_keep(pool, ...)     the same Decision for keep masks the caller chose (no scores)
    (caller)                 relock / release tree-owned victims, allocate pages for copies
                             (or, where `Decision.own_copies`, take the row's own part)
    apply(decision, copies)  slot plan, ONE repack launch for all rows, ONE row write
                             -> Applied (`step_apply.py`; the caller frees its pages in one call)

Its oracle is the per-row path in `tests/helpers/step_ref.py`
(`tests/runtime/lib/test_step.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.nn.utils.rnn import pad_sequence

from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.selection import check_budget, must_keep, select
from sgl_vtoken.step_plan import IndexPlan, RowCounts, index_plan
from sgl_vtoken.types import RowBatch, TokenView


@dataclass
class KVPoolView:
    """What the step reads and writes of a pool (SGLang's layout).

    Attributes:
        req_to_token: ``[rows, max_ctx]`` int32/int64 slot table.
        k_buffers, v_buffers: one ``[num_slots, H, D]`` tensor per layer.
        page_size: tokens per page.
        tp_gather: ``(tensor, dim) -> tensor`` with every tensor-parallel rank's heads on `dim`
            (None: one rank), so every rank takes the same decisions.
    """

    req_to_token: torch.Tensor
    k_buffers: list
    v_buffers: list
    page_size: int
    tp_gather: Callable | None = None

    def gather_heads(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t if self.tp_gather is None else self.tp_gather(t, dim)


@dataclass
class EvictRow:
    """One row that reached its trigger.

    Attributes:
        row: its `req_to_token` row.  length: live row entries L.
        positions: ``[L] int64`` logical positions (host).
        policy: rows holding the same policy object are scored together.
        budget: tokens kept.  cpl: tree-owned prefix (never moved or freed by the row).
        shared: the tree-owned prefix must be kept (False: its victims leave the row's view).
        rid, step: seeded policies' keys.  attn: ``[L, layers, H]`` statistic (attention policies).
        pinned: ``[L] bool`` entries kept like sinks (recalled tokens), or None.
        history: the row continues a stored history at page size > 1: `decide` also brings the
            ids of the tree-owned pages it keeps to the host (`Decision.kept_tree_pages`).
        own_from: row index from whose page on the kept tree-owned entries are copied to fresh
            private pages even where their pages are whole (the request's own prompt, which its
            tree lock would otherwise pin whole); None: only partly kept pages are copied. Rows
            with `shared` ignore it (their tree-owned prefix stays whole).
        units: ``[L] int64`` (host) each entry's unit (`TokenView.units`), for a policy with a
            `span`; None: every entry its own unit.
    """

    row: int
    length: int
    positions: torch.Tensor
    policy: EvictionPolicy
    budget: int
    cpl: int = 0
    shared: bool = False
    rid: int = 0
    step: int = 0
    attn: torch.Tensor | None = None
    pinned: torch.Tensor | None = None
    history: bool = False
    own_from: int | None = None
    units: torch.Tensor | None = None


@dataclass
class Decision:
    """What `decide` or `plan_keep` chose; host values unless noted."""

    table_rows: list[int]  # each row's `req_to_token` row
    keep: torch.Tensor  # [B, W] bool, host (False beyond each row's length)
    counts: list[RowCounts]  # one per row
    plan: IndexPlan  # device
    raw: torch.Tensor  # [B, W] int64 slots before the step (device)
    lengths: torch.Tensor  # [B] int64 (device)
    cpl: torch.Tensor  # [B] int64 (device)
    rows: list[EvictRow] = field(default_factory=list)  # decide's rows (plan_keep: none)
    tree_pages: torch.Tensor | None = None  # [B, P] int64 host: kept whole tree page ids, else -1
    # per row: it has an own part (`EvictRow.own_from`) and every copy comes from it, so the
    # copies may go onto that part's slots once it leaves the tree (`apply`'s `onto_own`)
    own_copies: list[bool] = field(default_factory=list)

    def kept_tree_pages(self, b: int) -> torch.Tensor:
        """Host ids of the tree-owned pages row `b` still references (rows with `history`)."""
        if self.tree_pages is None:
            raise ValueError("no row of this decision has `history`: its tree pages were not read")
        ids = self.tree_pages[b]
        return ids[ids >= 0]

    def keep_indices(self, b: int) -> torch.Tensor:
        """Ascending kept row indices of row `b` (host int64)."""
        return self.keep[b].nonzero().flatten()

    def new_length(self, b: int) -> int:
        return self.counts[b].new_length


def decide(rows: list[EvictRow], pool: KVPoolView) -> Decision:
    """Score every row on the pool's device, keep each row's `budget` best
    (`selection.select`, as `EvictionPolicy.keep`), and plan the indices; one device-to-host
    copy in all.

    Raises:
        ValueError: a policy misses a statistic it needs, or must keep more than its budget
            (nothing has changed then).
    """
    dev = pool.req_to_token.device
    for r in rows:
        if "attn" in r.policy.needs and r.attn is None:
            raise ValueError(f"policy {r.policy.name!r} needs TokenView.attn (got None)")
        if r.policy.span and r.units is None:
            raise ValueError(f"policy {r.policy.name!r} has a span and needs EvictRow.units")
    meta = torch.tensor(
        [
            (
                r.length,
                r.cpl,
                r.row,
                r.policy.sink,
                r.policy.window,
                r.cpl if r.shared else 0,
                r.budget,
                r.rid,
                r.step,
                r.cpl if r.own_from is None or r.shared else r.own_from,
            )
            for r in rows
        ],
        dtype=torch.int64,
    )
    lengths, cpl, idx, sink, window, shared, budget, rid, steps, own = to_device(meta, dev).unbind(
        1
    )
    spans = any(r.policy.span for r in rows)
    # Units ride with the positions (one copy): a row without a span is one unit per entry.
    lines = [r.positions for r in rows]
    if spans:
        lines += [r.units if r.policy.span and r.units is not None else r.positions for r in rows]
    stacked = to_device(pad_sequence(lines, batch_first=True), dev)
    positions, units = stacked[: len(rows)], stacked[len(rows) :] if spans else None
    w = positions.shape[1]
    j = torch.arange(w, device=dev)
    valid = j < lengths[:, None]
    raw = pool.req_to_token[idx, :w].to(torch.int64)  # beyond a row: written back unchanged
    scores = _scores(rows, pool, positions, valid, raw, rid, steps)
    extra = j < shared[:, None]  # the shared prefix, and pinned entries
    if any(r.pinned is not None for r in rows):
        pinned = pad_sequence(
            [
                torch.zeros(r.length, dtype=torch.bool) if r.pinned is None else r.pinned
                for r in rows
            ],
            batch_first=True,
        )
        extra[:, : pinned.shape[1]] |= to_device(pinned, dev)
    must = must_keep(positions, lengths, sink, window, extra)
    sel = select(scores, must, budget, lengths, units)
    table_rows = [r.row for r in rows]
    d, over = _plan(pool, table_rows, sel.keep, lengths, cpl, positions, raw, sel.over, rows, own)
    check_budget(over, [r.budget for r in rows], [r.policy.name for r in rows])
    return d


def plan_keep(
    pool: KVPoolView,
    rows: Sequence[int],
    keep: Sequence[torch.Tensor],
    cpl: Sequence[int],
    own_from: Sequence[int] | None = None,
) -> Decision:
    """Plan rows whose kept entries the caller chose, as `decide` plans its own; carry it out
    with `apply`. One device-to-host copy (the counts).

    Args:
        rows: each row's `req_to_token` row.
        keep: ``[L_b] bool`` per row (host or the pool's device): its first ``L_b`` entries,
            True = kept. Every entry ``>= L_b`` is outside the row (not freed, not written).
        cpl: each row's tree-owned prefix (page-aligned when page size > 1). A tree-owned entry
            the mask drops leaves the row as in `decide`: ``counts[b].copies`` may then ask
            for fresh pages (`apply`'s `copy_slots`). `counts[b].depth` counts row entries.
        own_from: each row's `EvictRow.own_from` (None: `cpl`, only partly kept pages copied).
    """
    dev = pool.req_to_token.device
    own = cpl if own_from is None else own_from
    meta = torch.tensor([(k.numel(), c, o) for k, c, o in zip(keep, cpl, own)], dtype=torch.int64)
    lengths, cpl_d, own_d = to_device(meta, dev).unbind(1)
    mask = to_device(pad_sequence([k.to(torch.bool) for k in keep], batch_first=True), dev)
    w = mask.shape[1]
    idx = to_device(torch.tensor(list(rows), dtype=torch.int64), dev)
    raw = pool.req_to_token[idx, :w].to(torch.int64)
    positions = torch.arange(w, device=dev).expand(len(rows), w)
    d, _ = _plan(
        pool,
        list(rows),
        mask,
        lengths,
        cpl_d,
        positions,
        raw,
        own_from=own_d,
        own=[None] * len(rows) if own_from is None else own_from,
    )
    return d


def _plan(
    pool: KVPoolView,
    table_rows: list[int],
    keep: torch.Tensor,
    lengths: torch.Tensor,
    cpl: torch.Tensor,
    positions: torch.Tensor,
    raw: torch.Tensor,
    over: torch.Tensor | None = None,
    rows: list[EvictRow] | None = None,
    own_from: torch.Tensor | None = None,
    own: Sequence[int | None] | None = None,
) -> tuple[Decision, list[int]]:
    """The index plan of `keep` and the step's one host copy: keep masks, counts, `over` (its
    host values are returned) and, for `rows` with `history`, their kept whole tree pages.
    `own`: each row's own part's start (`EvictRow.own_from`, taken from `rows` when None)."""
    ps, b, w = pool.page_size, keep.shape[0], keep.shape[1]
    plan = index_plan(keep, lengths, cpl, positions, ps, own_from)
    parts = [keep.to(torch.int64), plan.summary]
    parts.append(keep.new_zeros(b, 1, dtype=torch.int64) if over is None else over[:, None])
    history = any(r.history for r in rows or ())
    if history:  # whole kept tree pages: their first entry is whole
        parts.append(torch.where(plan.whole[:, ::ps], raw[:, ::ps] // ps, -1))
    host = torch.cat(parts, dim=1).cpu()  # the sync
    s = w + plan.summary.shape[1]
    counts = [RowCounts(*r) for r in host[:, w:s].tolist()]
    tree_pages = host[:, s + 1 :] if history else None
    keep_h = host[:, :w].bool()
    if own is None:
        own = [r.own_from for r in rows or ()]
    # Every copy comes from the own part when the first copy, the kept tree-owned entry after
    # the `whole` ones that stay in place, is in it: no more than `whole` kept before it.
    own_copies = [
        o is not None and int(keep_h[i, :o].sum()) <= c.whole
        for i, (o, c) in enumerate(zip(own, counts))
    ]
    d = Decision(
        table_rows, keep_h, counts, plan, raw, lengths, cpl, rows or [], tree_pages, own_copies
    )
    return d, host[:, s].tolist()


def _scores(
    rows: list[EvictRow],
    pool: KVPoolView,
    positions: torch.Tensor,
    valid: torch.Tensor,
    raw: torch.Tensor,
    rid: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """``[B, W] float64`` scores: one `score_rows` call per policy object, else row by row."""
    out = torch.zeros(positions.shape, dtype=torch.float64, device=positions.device)
    groups: dict[int, list[int]] = {}
    for b, r in enumerate(rows):
        groups.setdefault(id(r.policy), []).append(b)
    for members in groups.values():
        pol = rows[members[0]].policy
        pick = (
            slice(None)
            if len(members) == len(rows)
            else to_device(torch.tensor(members), positions.device)
        )
        sub = raw[pick]
        batch = RowBatch(
            positions[pick],
            valid[pick],
            rid[pick],
            steps[pick],
            key_norms=partial(_key_norms, pool, sub),
        )
        s = pol.score_rows(batch)
        if s is not None:
            out[pick] = s.to(torch.float64)
            continue
        for b in members:
            n = rows[b].length
            out[b, :n] = pol.score(row_view(rows[b], pool, raw[b, :n], positions[b, :n]))
    return out


def row_view(
    r: EvictRow, pool: KVPoolView, slots: torch.Tensor, positions: torch.Tensor
) -> TokenView:
    """The `TokenView` of one row, read on the pool's device (keys only if needed)."""

    def gather(buffers: list[torch.Tensor]) -> torch.Tensor:
        return pool.gather_heads(torch.stack([buf[slots] for buf in buffers], dim=1), dim=2)

    needs = r.policy.needs
    shared = torch.arange(r.length, device=slots.device) < r.cpl if r.shared else None
    return TokenView(
        positions=positions,
        keys=gather(pool.k_buffers) if "keys" in needs else None,
        attn=r.attn,
        shared=shared,
        rid=r.rid,
        step=r.step,
        units=None if r.units is None else r.units.to(slots.device),
    )


def _key_norms(pool: KVPoolView, slots: torch.Tensor) -> torch.Tensor:
    """``[B, W, L, H] float32`` key norms of `slots` ``[B, W]``, layer by layer."""
    flat = slots.flatten()
    norms = torch.stack([buf[flat].float().norm(dim=-1) for buf in pool.k_buffers], dim=1)
    return pool.gather_heads(norms, dim=2).view(*slots.shape, *norms.shape[1:])


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (no host synchronization)."""
    return t.to(device, non_blocking=True)
