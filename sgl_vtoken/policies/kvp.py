"""KVP: learned eviction; per-(layer, KV head) MLPs score tokens from their cached K, V and age.

Moschella, Manduchi, Sener, "Learning to Evict from Key-Value Cache", arXiv:2602.10238. The
scorers (:mod:`sgl_vtoken.kvp`, trained by ``scripts/train_kvp.py``) read the K/V the server
already holds, so no attention pass is needed. Each head's scores become a distribution over the
row (softmax: the Plackett-Luce probability of being ranked first), aggregated (sum or max) over
layers and heads to one score per token. Kept: sinks, window, and the highest-scored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_vtoken.kvp import KVPScorer, ModelIdentity, load_scorer
from sgl_vtoken.policies.base import EvictionPolicy, aggregate
from sgl_vtoken.types import TokenView


@dataclass
class KVP(EvictionPolicy):
    """Score = aggregate(softmax over the row of each head's scorer output); `checkpoint`: the
    path of a trained scorer (required)."""

    checkpoint: str = ""  # required: the path of a trained scorer
    name: ClassVar[str] = "kvp"
    needs: ClassVar[tuple[str, ...]] = ("keys", "values")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ValueError(
                "KVP.checkpoint is required: the path of a scorer trained by "
                f'scripts/train_kvp.py, e.g. {{"checkpoint": PATH}} (got {self.checkpoint!r})'
            )
        load_scorer(self.checkpoint)  # fails now, naming the path, not at the first eviction

    @property
    def scorer(self) -> KVPScorer:
        return load_scorer(self.checkpoint)

    def check_model(self, hf_config: dict) -> None:
        """ValueError naming every field where the served model differs from the checkpoint's."""
        self.scorer.identity.check(ModelIdentity.from_hf_config(hf_config))

    def score(self, view: TokenView) -> torch.Tensor:
        with torch.no_grad():
            keys = view.require("keys")
            scorer = self.scorer.to(keys.device)  # scores where the KV lives (no-op after once)
            s = scorer(keys, view.require("values"), view.positions).to(torch.float64)
        return aggregate(torch.softmax(s, dim=0), self.aggregation)
