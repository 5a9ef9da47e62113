"""The interfaces through which the Hugging Face oracle (`hf_reference`) asks who is evicted
and what is recalled: the caller passes objects of these shapes (`tests/runtime/oracles` the
independent ones, `sgl_vtoken_tools.runtime_choice` the runtime's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from sgl_vtoken.config import EvictConfig


class RequestPolicy(Protocol):
    """One request's victim chooser (it holds the request's statistics and eviction count)."""

    needs: frozenset[str]  # what `keep` reads: "attn" (via `observe`), "keys"

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        """Fold queries' attention ``probs [q, n, layers, kv_heads]`` (every layer, summed over
        each KV head's query heads) over the `row` positions; ``lengths [q]``: the row entries
        each query attends (the first ones; zeros beyond)."""

    def keep(
        self,
        row: list[int],
        shared: list[bool],
        keys: torch.Tensor | None,
        budget: int,
        texts: list[str],
    ) -> list[int]:
        """One eviction of the `row` positions to `budget`: ascending row indices kept; the
        `shared` entries (tree-owned, recalled) must be. Keys ``[n, layers, kv_heads,
        d]`` (post-RoPE) when `needs` them; `texts` the decoded text of every token of the
        sequence so far (index = position) when the config has a `span`, else empty."""


class RecallRule(Protocol):
    """The host tier's recall: where a recalling prefill is cut, the rounds, which come back."""

    def split(self, cfg: EvictConfig, prefix: int, total: int) -> tuple[int, int] | None: ...

    def rounds(self, cfg: EvictConfig) -> int: ...

    def quota(self, cfg: EvictConfig, done: int, last: bool) -> int: ...

    def choose(
        self,
        cfg: EvictConfig,
        layers: list,
        lengths: torch.Tensor,
        k: int,
        positions: list[int],
        recalled: list[int],
    ) -> list[int]:
        """Indices of the `k` candidates recalled; `layers`: ``(queries [nq, hq, d], scale,
        row_keys [n, hkv, d], cand_keys [c, hkv, d])`` of every layer in order; `positions`
        the candidates' (ascending), `recalled` those the turn's earlier rounds brought back."""


PolicyFactory = Callable[[EvictConfig, str], RequestPolicy]
