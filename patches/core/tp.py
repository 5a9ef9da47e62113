"""Tensor parallelism: each rank holds some KV heads; eviction decisions need all of them, so that
every rank evicts the same tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sglang_types import TpGroup


def tp_gather(t: torch.Tensor, tp_group: TpGroup | None, dim: int) -> torch.Tensor:
    """`t` (per-rank KV heads on `dim`) with every TP rank's heads, on every rank, on `t`'s
    device."""
    if tp_group is None or tp_group.world_size == 1:
        return t
    return tp_group.all_gather(t.to(tp_group.device), dim=dim).to(t.device)
