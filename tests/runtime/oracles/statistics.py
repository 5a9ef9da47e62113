"""Attention statistics of the attention policies, kept per cached token (by position).

Every `observe` receives ``probs [q, n, L, H]``: the attention probabilities of `q` consecutive
queries (oldest first) over the row's `n` tokens, for the scored layers only, summed over the
query heads of each KV head, with ``lengths [q]`` the keys each query attended (the rest are
zero). A token leaving the cache leaves the statistic; one coming back (recalled) starts anew.
"""

from __future__ import annotations

from collections import deque

import torch


class _PerToken:
    """One tensor per cached token (by position): zeros for a token no query has seen yet, gone
    with the token."""

    def __init__(self) -> None:
        self.value: dict[int, torch.Tensor] = {}

    def stat(self, row: list[int]) -> torch.Tensor:
        return torch.stack([self.value.get(p, torch.zeros(self.shape)) for p in row])

    def forget(self, gone: set[int]) -> None:
        for p in gone:
            self.value.pop(p, None)


class AccumulatedAttention(_PerToken):
    """Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", NeurIPS 2023, arXiv:2306.14048: a token's importance is the attention it
    received from every query so far (float32, per layer and head)."""

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        self.shape = probs.shape[2:]
        block = probs.sum(0).float()
        for j, p in enumerate(row):
            self.value[p] = self.value[p] + block[j] if p in self.value else block[j]


class LastQueryAttention(_PerToken):
    """Oren et al., "Transformers are Multi-State RNNs", EMNLP 2024, arXiv:2401.06104 (TOVA):
    a token's importance is the attention the newest query gave it."""

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        self.shape = probs.shape[2:]
        self.value = {p: probs[-1, j].float() for j, p in enumerate(row)}


class PersistentImportance:
    """Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV
    Cache Compression at Test Time", NeurIPS 2023, arXiv:2305.17118: a token is unimportant to
    a query that gave it less than ``threshold / num_attended``; the tokens unimportant to the
    most of the last `history` queries go first. Statistic: minus that count, per layer and
    head (a query that did not attend a token, or came before it entered, does not count)."""

    def __init__(self, history: int = 32, threshold: float = 1.0) -> None:
        self.threshold = threshold
        self.recent: deque[dict[int, torch.Tensor]] = deque(maxlen=history)

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        self.shape = probs.shape[2:]
        for i in range(probs.shape[0]):
            m = int(lengths[i])
            low = probs[i, :m] < self.threshold / max(m, 1)
            self.recent.append({p: low[j] for j, p in enumerate(row[:m])})

    def stat(self, row: list[int]) -> torch.Tensor:
        zero = torch.zeros(self.shape)
        return torch.stack([-sum((q[p].float() for q in self.recent if p in q), zero) for p in row])

    def forget(self, gone: set[int]) -> None:
        for q in self.recent:
            for p in gone:
                q.pop(p, None)
