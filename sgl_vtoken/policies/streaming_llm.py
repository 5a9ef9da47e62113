"""StreamingLLM: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453. Kept: positions < `sink` and the newest ``budget - sink`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.types import RowBatch, TokenView


@dataclass
class StreamingLLM(EvictionPolicy):
    """Score = position: the newest tokens win; sinks are protected by the base class."""

    name: ClassVar[str] = "streamingllm"

    def score(self, view: TokenView) -> torch.Tensor:
        return view.positions.to(torch.float64)

    def score_rows(self, batch: RowBatch) -> torch.Tensor:
        return batch.positions.to(torch.float64)
