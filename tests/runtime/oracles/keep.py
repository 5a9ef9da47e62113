"""The keep rule shared by every policy: which row entries survive one eviction."""

from __future__ import annotations

import math


def keep_best(scores: list[float], protected: list[bool], budget: int) -> list[int]:
    """Ascending row indices of the ``min(n, budget)`` entries kept: every protected entry, then
    the highest scores; of equal scores the later entry wins, NaN ranks last.

    Raises:
        ValueError: the protected entries outnumber `budget`.
    """
    n = len(scores)
    if n <= budget:
        return list(range(n))
    if sum(protected) > budget:
        raise ValueError(f"budget {budget} is smaller than the {sum(protected)} protected tokens")
    rank = sorted(
        range(n),
        key=lambda i: (protected[i], -math.inf if math.isnan(scores[i]) else scores[i], i),
        reverse=True,
    )
    return sorted(rank[:budget])


def protected_entries(
    positions: list[int], sink: int, window: int, shared: list[bool] | None = None
) -> list[bool]:
    """Entries kept whatever their score: attention sinks (position < `sink`), the last `window`
    row entries (the recent window), and the `shared` ones (another owner's, or pinned)."""
    n = len(positions)
    shared = shared or [False] * n
    return [p < sink or i >= n - window or s for i, (p, s) in enumerate(zip(positions, shared))]
