"""TOVA: keep the tokens the newest query attends to most.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104. The paper
averages the last query's attention over heads (``sum`` aggregation ranks the same).
``TokenView.attn`` comes from :class:`sgl_vtoken.stats.LastAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sgl_vtoken.policies.base import AttentionPolicy
from sgl_vtoken.stats import LastAttention


@dataclass
class TOVA(AttentionPolicy):
    """Score = aggregate(last query's attention probabilities) over layers and heads."""

    name: ClassVar[str] = "tova"
    accumulator: ClassVar[type] = LastAttention
