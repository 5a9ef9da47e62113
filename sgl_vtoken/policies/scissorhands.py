"""Scissorhands: drop the tokens that were unimportant most often over a history window.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023, arXiv:2305.17118. A token is low-importance at a step
when its attention is below ``threshold / num_attended``; the statistic is minus the count of
such steps among the last `history` queries, so the tokens most persistently unimportant go
first. The recent window is protected as in the paper.
``TokenView.attn`` comes from :class:`sgl_vtoken.stats.LowImportanceCount`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from sgl_vtoken.policies.base import AttentionPolicy
from sgl_vtoken.stats import LowImportanceCount


@dataclass
class Scissorhands(AttentionPolicy):
    """Score = aggregate(-low-importance count); `history` and `threshold` set the counter."""

    history: int = 32
    threshold: float = 1.0
    name: ClassVar[str] = "scissorhands"
    accumulator: ClassVar[type] = LowImportanceCount

    def __post_init__(self) -> None:
        super().__post_init__()
        LowImportanceCount(self.history, self.threshold)  # validates both, naming the field

    def new_accumulator(self, **kwargs: Any) -> LowImportanceCount:
        return LowImportanceCount(history=self.history, threshold=self.threshold, **kwargs)
