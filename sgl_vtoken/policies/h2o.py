"""H2O: heavy hitters by accumulated attention, plus the recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023, arXiv:2306.14048. Kept: the window (set `window`, e.g. half the budget as in
the paper) and the tokens with the largest attention received from all queries so far.
``TokenView.attn`` comes from :class:`sgl_vtoken.stats.AttentionSum`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sgl_vtoken.policies.base import AttentionPolicy
from sgl_vtoken.stats import AttentionSum


@dataclass
class H2O(AttentionPolicy):
    """Score = aggregate(accumulated attention) over layers and heads; by default the largest
    over them (``max``: a token any scored head keeps returning to is kept, where ``sum`` lets
    the many heads that attend broadly outvote it)."""

    aggregation: str = "max"

    name: ClassVar[str] = "h2o"
    accumulator: ClassVar[type] = AttentionSum
