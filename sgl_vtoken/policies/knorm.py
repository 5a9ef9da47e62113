"""Key-norm eviction: keep the tokens whose keys have the LOWEST L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024, arXiv:2406.11430; kvpress ``KnormPress`` scores ``-keys.norm(dim=-1)``.
Per-layer, per-head scores are aggregated (sum or max) to one score per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_vtoken.policies.base import EvictionPolicy, aggregate
from sgl_vtoken.types import RowBatch, TokenView


@dataclass
class KNorm(EvictionPolicy):
    """Score = aggregate(-||k||) over layers and heads."""

    name: ClassVar[str] = "knorm"
    needs: ClassVar[tuple[str, ...]] = ("keys",)

    def score(self, view: TokenView) -> torch.Tensor:
        return aggregate(-view.require("keys").float().norm(dim=-1), self.aggregation)

    def score_rows(self, batch: RowBatch) -> torch.Tensor | None:
        if batch.key_norms is None:
            return None
        norms = batch.key_norms()  # [B, W, L, H]
        return aggregate(-norms.flatten(0, 1), self.aggregation).view(norms.shape[:2])
