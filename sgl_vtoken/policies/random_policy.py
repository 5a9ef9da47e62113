"""Random eviction: the baseline of the evaluations.

Scores are a counter-based hash of (seed, request id, eviction step, position), so the victims
are reproducible by anyone holding those integers (see :mod:`sgl_vtoken.rng`), independent of
device and batch. Kept: sinks, window, and a uniformly random subset of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.rng import hash_u01
from sgl_vtoken.types import RowBatch, TokenView


@dataclass
class RandomPolicy(EvictionPolicy):
    """Score = hash_u01(position, seed, rid, step)."""

    seed: int = 0
    name: ClassVar[str] = "random"

    def score(self, view: TokenView) -> torch.Tensor:
        return hash_u01(view.positions, self.seed, view.rid, view.step)

    def score_rows(self, batch: RowBatch) -> torch.Tensor:
        return hash_u01(batch.positions, self.seed, batch.rids[:, None], batch.steps[:, None])
