"""Recall from the host tier: which evicted tokens a new turn brings back (pure torch).

A turn continuing a stored view is prefilled in two chunks (`split`); the last `obs_window`
queries of the first chunk score every candidate (an evicted token below the view's depth that
the view does not hold) by its share of one softmax over the row and the candidates together
(`candidate_mass`), and `pick` takes the best after pooling over `POOL` neighbours, holes of
at most `GAP` between them; `recall_rounds` repeats it with what came back visible. The server
(`patches/step/scores.py`) calls these functions; the statistic and its rounds:
docs/design/cache.md, "The recall statistic".
"""

from __future__ import annotations

import bisect

import torch

from sgl_vtoken.policies.base import smooth
from sgl_vtoken.selection import ranking

# The server's recall rule (`pick`): each candidate's score averaged over POOL candidate neighbours
# (SnapKV's pooling, so a recalled token brings the digits of its number), and holes of at most
# GAP candidates between recalled ones filled; the best one-round rule of the tuning split
# (docs/results/recall-in-rounds.md), no longer a setting.
POOL, GAP = 5, 8


def window_probs(
    q: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, scale: float, open_tail: int = 0
) -> torch.Tensor:
    """``[nq, hq, n]`` float32 softmax of each query over `keys` (query head h reads KV head
    ``h // (hq // hkv)``): query j sees the first ``lengths[j]`` keys and the last `open_tail`
    keys (the candidates, seen by every query); the rest are masked.

    Args:
        q: ``[nq, hq, d]`` post-RoPE queries of one layer.
        keys: ``[n, hkv, d]``.
        lengths: ``[nq]`` int64, each ``<= n - open_tail``.
    """
    n, g = keys.shape[0], q.shape[1] // keys.shape[1]
    logits = (
        torch.einsum("qhd,nhd->qhn", q.float(), keys.float().repeat_interleave(g, dim=1)) * scale
    )
    hidden = torch.arange(n, device=q.device)[None, :] >= lengths.to(q.device)[:, None]
    if open_tail:
        hidden[:, n - open_tail :] = False
    return torch.softmax(logits.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)


def candidate_mass(
    q: torch.Tensor,
    row_keys: torch.Tensor,
    lengths: torch.Tensor,
    cand_keys: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[c] float32``: the probability mass each candidate gets from the queries, in one
    distribution with the row (`window_probs` over row + candidates).

    Args:
        q: ``[nq, hq, d]`` post-RoPE queries of one layer.
        row_keys: ``[n, hkv, d]`` keys of the row; query j sees the first ``lengths[j]``.
        lengths: ``[nq]`` int64.
        cand_keys: ``[c, hkv, d]`` keys of the candidates (all seen by every query).
        scale: the attention scale.
    """
    keys = torch.cat([row_keys, cand_keys.to(row_keys.device)])
    probs = window_probs(q, keys, lengths, scale, open_tail=cand_keys.shape[0])
    return probs[:, :, row_keys.shape[0] :].sum(dim=(0, 1))


def split(prefix: int, total: int, window: int, page_size: int) -> tuple[int, int] | None:
    """Row lengths where a recalling turn's prefill is cut, or None when the new tokens do not
    cross a page boundary before the last one (the turn recalls nothing)::

        row   | prefix (the view) | new tokens ............................. |
              0                prefix         back          end         total
        chunk 1                   [---------------------------)    last `window` queries score
        chunk 2                               [-------------------------)   recalled visible

    `end`: the last page boundary before the prompt's last token (chunk 1 is never the whole
    prompt, so SGLang samples nothing from it); `back`: `window` rounded up to whole pages
    before `end`, not below the prefix (chunk 1's K/V past `back` is dropped and recomputed)."""
    end = (total - 1) // page_size * page_size
    if end <= prefix:
        return None
    return end, max(prefix, end - -(-window // page_size) * page_size)


def pick(
    scores: torch.Tensor,
    k: int,
    pool: int = 1,
    gap: int = 0,
    positions: torch.Tensor | None = None,
    recalled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ascending indices of the `k` best `scores` ``[c]`` (candidates in position order; ties:
    the later one); all of them when ``c <= k``. With `pool` (odd) each score is first the mean
    over its candidate neighbours, ``pool // 2`` on each side (SnapKV's pooling): a recalled
    token brings its span (the digits of a number) with it. With `gap`, candidates are taken
    best first, each with the hole (at most `gap` candidates) between it and a taken neighbour;
    one that would overflow `k` with its holes is passed over::

        taken:  3 4                  next best 8, gap 3:  3 4 [5 6 7] 8   (its hole joins)
                                     next best 8, gap 2:  3 4  .  .  .  8  (the hole stays open)

    so a sentence whose ends the statistic marks comes back whole. `recalled` (positions the
    turn's earlier rounds brought back; `positions` ``[c]`` ascending: the candidates') are
    taken neighbours too, not counted in `k`: a hole between this round's token and an earlier
    round's is filled as one round would fill it, so a number recalled over two rounds comes
    back without missing digits.
    """
    order = ranking(smooth(scores.double().cpu(), pool))
    if not gap or k >= order.numel():
        return order[:k].sort().values
    before: list[int] = []
    slot = list(range(order.numel()))  # candidate index -> its index among all taken-able
    if recalled is not None and recalled.numel():
        assert positions is not None, "recalled positions need the candidates' positions"
        pos = positions.cpu().tolist()
        merged = sorted(pos + recalled.cpu().tolist())
        at = {p: j for j, p in enumerate(merged)}
        slot = [at[p] for p in pos]
        before = [at[p] for p in recalled.cpu().tolist()]
    back = {j: i for i, j in enumerate(slot)}
    taken: list[int] = sorted(before)
    for i in (slot[c] for c in order.tolist()):
        if len(taken) - len(before) == k:
            break
        j = bisect.bisect(taken, i)
        if j and taken[j - 1] == i:
            continue  # already taken as part of a hole
        lo = taken[j - 1] + 1 if j and i - taken[j - 1] <= gap + 1 else i
        hi = taken[j] if j < len(taken) and taken[j] - i <= gap + 1 else i + 1
        if len(taken) - len(before) + hi - lo <= k:
            taken[j:j] = range(lo, hi)  # i with its holes: the run between its neighbours
    return torch.tensor([back[j] for j in taken if j in back], dtype=torch.int64)


def turn_rounds(recall: int, rounds: int) -> int:
    """Rounds a turn recalls in: `recall_rounds`, at most one per recalled token."""
    return min(rounds, recall)


def round_quota(recall: int, rounds: int, done: int, last: bool) -> int:
    """Tokens one round may recall: ``recall // turn_rounds``, the last round what the `done`
    of the rounds before left of `recall`."""
    return recall - done if last else recall // turn_rounds(recall, rounds)


def dedupe(positions: torch.Tensor, below: int, exclude: torch.Tensor) -> torch.Tensor:
    """Indices into `positions` ``[m]`` of the candidates: the first occurrence of each position
    ``< below`` that is not in `exclude`, ordered by position."""
    ok = (positions < below) & ~torch.isin(positions, exclude)
    idx = ok.nonzero().flatten()
    if not idx.numel():
        return idx
    pos = positions[idx]
    order = torch.sort(pos, stable=True).indices
    idx, pos = idx[order], pos[order]
    first = torch.ones_like(pos, dtype=torch.bool)
    first[1:] = pos[1:] != pos[:-1]
    return idx[first]
