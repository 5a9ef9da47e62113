"""Recall from the host tier: which evicted tokens a new turn brings back (pure torch).

A new turn continues from a stored view; the tokens its history evicted earlier sit in the host
store (`patches/host_tier.py`), each with its K/V as computed when it was prefilled or decoded.
After the new message's prefill, the last `obs_window` queries of the message score every
candidate (an evicted token below the view's depth that the view does not hold) with the
statistic SnapKV uses, but over both tiers at once::

    query j (post-RoPE, every query head), per layer in score_layers:
        p = softmax( [q_j . K_row[:lengths[j]] ,  q_j . K_cand] * scale )    (one distribution)
        score[c] += sum over query heads of p[row part ends + c]
    recalled = the `recall` best candidates after `recall_pool` smoothing over candidate
               neighbours (ties: the later position), ascending positions

Candidates are never attended while the message is prefilled: the distribution is only a
statistic. The server (`patches/scores.py`) and the Hugging Face reference
(`sgl_vtoken.hf_reference`) call the same two functions.
"""

from __future__ import annotations

import torch

from sgl_vtoken.policies.base import smooth, top_budget


def candidate_mass(q: torch.Tensor, row_keys: torch.Tensor, lengths: torch.Tensor,
                   cand_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[c] float32``: the probability mass each candidate gets from the queries.

    Args:
        q: ``[nq, hq, d]`` post-RoPE queries of one layer.
        row_keys: ``[n, hkv, d]`` keys of the row; query j sees the first ``lengths[j]``.
        lengths: ``[nq]`` int64.
        cand_keys: ``[c, hkv, d]`` keys of the candidates (all seen by every query).
        scale: the attention scale.
    """
    nq, hq, n, c = q.shape[0], q.shape[1], row_keys.shape[0], cand_keys.shape[0]
    g = hq // row_keys.shape[1]
    keys = torch.cat([row_keys, cand_keys.to(row_keys.device)]).float().repeat_interleave(g, dim=1)
    logits = torch.einsum("qhd,nhd->qhn", q.float(), keys) * scale            # [nq, hq, n + c]
    hidden = torch.arange(n + c, device=q.device)[None, :] >= lengths.to(q.device)[:, None]
    hidden[:, n:] = False
    logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)[:, :, n:].sum(dim=(0, 1))


def pick(scores: torch.Tensor, k: int, pool: int = 1) -> torch.Tensor:
    """Ascending indices of the `k` best `scores` ``[c]`` (candidates in position order; ties:
    the later one); all of them when ``c <= k``. With `pool` (odd) each score is first the mean
    over its candidate neighbours, ``pool // 2`` on each side (SnapKV's pooling): a recalled
    token brings its span (the digits of a number) with it."""
    return top_budget(smooth(scores.double().cpu(), pool), k)


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
