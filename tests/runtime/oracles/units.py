"""Span-aware keeping, restated: words and digit runs are kept or dropped whole.

A token joins the previous token's unit when its text begins with a letter or digit and the
previous token's text ends with one; a unit is cut into pieces of `span` tokens. An entry scores
as its unit's best entry; after the keep rule, an unprotected entry of a unit kept in part goes.
"""

from __future__ import annotations

import math

from .keep import keep_best


def unit_starts(texts: list[str], span: int) -> list[int]:
    """For each token of a sequence (its decoded text, position = index): the position of the
    first token of its unit, the unit cut into pieces of `span` tokens."""
    out, start = [], 0
    for i, text in enumerate(texts):
        if i == 0 or not (text[:1].isalnum() and texts[i - 1][-1:].isalnum()):
            start = i
        out.append(start + (i - start) // span * span)
    return out


def keep_whole_units(
    scores: list[float], protected: list[bool], budget: int, units: list[int]
) -> list[int]:
    """`keep_best` of the unit-pooled scores, without the unprotected entries of units kept in
    part (ascending row indices)."""
    best: dict[int, float] = {}
    for s, u in zip(scores, units):
        v = -math.inf if math.isnan(s) else s
        best[u] = max(best.get(u, -math.inf), v)
    kept = keep_best([best[u] for u in units], protected, budget)
    chosen = set(kept)
    whole = {u: all(i in chosen for i, w in enumerate(units) if w == u) for u in set(units)}
    return [i for i in kept if whole[units[i]] or protected[i]]
