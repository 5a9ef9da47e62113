"""The host tier's recall rule: which evicted tokens a new turn brings back.

The candidates are scored as SnapKV scores a prompt's tokens (Li et al., "SnapKV: LLM Knows What
You are Looking for Before Generation", arXiv:2404.14469): the attention the last window of the
prompt's queries gives them, pooled over neighbours; here the candidates join the row's keys in
one softmax per query and head (they are not attended, the distribution is only a statistic),
and the best come back with the holes between them (a span whose ends score returns whole).
"""

from __future__ import annotations

import torch

from .request import scored_layers
from .scores import pooled

# The recall rule's pooling width and the longest hole filled between recalled candidates
POOL, GAP = 5, 8


def candidate_mass(q, scale, row_keys, lengths, cand_keys) -> torch.Tensor:
    """``[c]``: the probability each candidate gets, summed over the window's queries and every
    query head, in one softmax over the keys each query attends (the first ``lengths[j]`` of
    the row) and all candidates. ``q [nq, hq, d]``, keys ``[n, hkv, d]`` (query head h reads
    KV head ``h // (hq // hkv)``), ``cand_keys [c, hkv, d]``."""
    group = q.shape[1] // row_keys.shape[1]
    mass = torch.zeros(cand_keys.shape[0])
    for j in range(q.shape[0]):
        keys = torch.cat([row_keys[: int(lengths[j])], cand_keys])  # [m + c, hkv, d]
        for h in range(q.shape[1]):
            logits = keys[:, h // group].float() @ q[j, h].float() * scale
            mass += torch.softmax(logits, 0)[-cand_keys.shape[0] :]
    return mass


def pick(
    scores: list[float],
    k: int,
    pool: int,
    gap: int,
    positions: list[int] = (),
    recalled: list[int] = (),
) -> list[int]:
    """Ascending indices of the `k` candidates recalled: best pooled score first (ties: the later
    candidate); with `gap`, each taken with the run of at most `gap` candidates between it and
    an already taken neighbour, and one whose run would overflow `k` is passed over. The
    `recalled` positions (earlier rounds of the turn) are taken neighbours from the start and
    do not count in `k`; `positions` are the candidates' (ascending)."""
    s = pooled(scores, pool)
    order = sorted(range(len(s)), key=lambda i: (s[i], i), reverse=True)
    if not gap or k >= len(s):
        return sorted(order[:k])
    # Walk in position space: a run's length counts the candidates between two taken positions.
    where = list(positions) if recalled else list(range(len(s)))
    anchors = set(recalled)
    taken: set[int] = set()

    def between(a: int, b: int) -> list[int]:
        return [c for c in range(len(s)) if a < where[c] < b]

    for i in order:
        if len(taken) == k:
            break
        if i in taken:
            continue
        p = where[i]
        sides = [where[t] for t in taken] + list(anchors)
        left = max((q for q in sides if q < p), default=None)
        right = min((q for q in sides if q > p), default=None)
        run = {i}
        if left is not None and len(between(left, p)) <= gap:
            run |= set(between(left, p))
        if right is not None and len(between(p, right)) <= gap:
            run |= set(between(p, right))
        if len(taken) + len(run) <= k:
            taken |= run
    return sorted(taken)


class OracleRecall:
    """The recall rule (`hf_rules.RecallRule`), settings read from an `EvictConfig`."""

    def split(self, cfg, prefix: int, total: int) -> tuple[int, int] | None:
        """Row lengths ``(end, back)`` where the prefill is cut: `end` the last page boundary
        before the prompt's last token, `back` the scoring window rounded up to whole pages
        before it, not below `prefix`; None when `end` does not pass `prefix`."""
        page, window = cfg.page_size, cfg.scoring.obs_window
        end = (total - 1) // page * page
        if end <= prefix:
            return None
        pages = (window + page - 1) // page
        return end, max(prefix, end - pages * page)

    def rounds(self, cfg) -> int:
        """Rounds a turn recalls in: `recall_rounds`, at most one per recalled token."""
        return min(cfg.host.rounds, cfg.host.recall)

    def quota(self, cfg, done: int, last: bool) -> int:
        """Tokens a round recalls: an equal share, the last round what is left."""
        return cfg.host.recall - done if last else cfg.host.recall // self.rounds(cfg)

    def choose(self, cfg, layers, lengths, k: int, positions=(), recalled=()) -> list[int]:
        """Indices of the `k` candidates recalled; `layers`: ``(q, scale, row_keys, cand_keys)``
        of every layer in order, summed over the scored ones; `positions` the candidates',
        `recalled` the positions the turn's earlier rounds brought back (taken neighbours)."""
        total = torch.zeros(layers[0][3].shape[0])
        for i in scored_layers(cfg.scoring.score_layers, len(layers)):
            q, scale, row_keys, cand_keys = layers[i]
            total += candidate_mass(q, scale, row_keys, lengths, cand_keys)
        return pick(total.tolist(), k, POOL, GAP, list(positions), list(recalled))


ORACLE_RECALL = OracleRecall()
