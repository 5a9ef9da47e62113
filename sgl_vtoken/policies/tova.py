"""TOVA: keep the tokens the newest query attends to most.

Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104. The paper
averages the last query's attention over heads (``sum`` aggregation ranks the same).
``TokenView.attn`` comes from :class:`sgl_vtoken.stats.LastAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_vtoken.policies.base import EvictionPolicy, aggregate
from sgl_vtoken.stats import LastAttention
from sgl_vtoken.types import TokenView


@dataclass
class TOVA(EvictionPolicy):
    """Score = aggregate(last query's attention probabilities) over layers and heads."""

    name: ClassVar[str] = "tova"
    needs: ClassVar[tuple[str, ...]] = ("attn",)
    accumulator: ClassVar[type] = LastAttention

    def score(self, view: TokenView) -> torch.Tensor:
        return aggregate(view.attn, self.aggregation)
