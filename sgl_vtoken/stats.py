"""Per-token attention statistics that attention-based policies read as ``TokenView.attn``.

Attention kernels never materialize probabilities, so the server computes them with a side
kernel on each new query and feeds them here. Every accumulator is row-ordered, like the row it
describes: new tokens append at the end, and after an eviction ``select(keep)`` applies the same
row indices the policy returned. The math lives in plain functions (usable on slot-indexed
buffers too); the classes only hold state.

Shapes: ``probs [q, n, L, H]`` are the attention probabilities of `q` consecutive queries
(oldest first) over the row's `n` tokens for `L` layers and `H` heads; a query that attends to
fewer keys (causal block) has zeros beyond its length ``lengths[i]``.
"""

from __future__ import annotations

import torch


def attention_sum_update(acc: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """H2O: ``acc [n, L, H] + sum over queries of probs [q, n, L, H]``."""
    return acc + probs.sum(dim=0).to(acc.dtype)


def low_importance_update(
    bits: torch.Tensor,
    probs: torch.Tensor,
    history: int,
    threshold: float = 1.0,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scissorhands counter as a shift register: bit i set = low importance i queries ago.

    A key is low-importance for a query when ``prob < threshold / num_attended``; keys a query
    does not attend to (beyond ``lengths[i]``) record 0. Only the last `history` queries matter.

    Args:
        bits: ``[n, L, H] int64`` register, bits ``< history`` only.
        probs: ``[q, n, L, H]`` float.
        lengths: ``[q] int64`` keys attended by each query (default: all n).
    """
    q, n = probs.shape[0], probs.shape[1]
    if lengths is None:
        lengths = torch.full((q,), n, dtype=torch.int64, device=probs.device)
    take = min(q, history)
    probs, lengths = probs[q - take :], lengths[q - take :]
    idx = torch.arange(n, device=probs.device)
    attended = idx[None, :] < lengths[:, None]  # [take, n]
    limit = threshold / lengths.clamp(min=1).to(probs.dtype)  # [take]
    low = (probs < limit.view(-1, 1, 1, 1)) & attended.view(take, n, 1, 1)  # [take, n, L, H]
    shifts = torch.arange(take - 1, -1, -1, device=probs.device).view(-1, 1, 1, 1)
    new = (low.to(torch.int64) << shifts).sum(dim=0)
    survivors = bits & ((1 << (history - take)) - 1)  # bits that stay inside the window
    return (survivors << take) | new


def low_importance_count(bits: torch.Tensor, history: int) -> torch.Tensor:
    """``[n, L, H] int64`` number of set bits among the low `history` bits."""
    shifts = torch.arange(history, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).sum(dim=-1)


class RowStats:
    """Shared mechanics: a ``[n, L, H]`` state that grows with the row and follows evictions."""

    dtype = torch.float32

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return 0 if self.state is None else self.state.shape[0]

    def _grow(self, probs: torch.Tensor) -> torch.Tensor:
        n, tail = probs.shape[1], probs.shape[2:]
        if self.state is None:
            self.state = torch.zeros((0, *tail), dtype=self.dtype, device=probs.device)
        if n < self.n:
            raise ValueError(f"probs cover {n} tokens but the row has {self.n}")
        if n > self.n:
            pad = torch.zeros((n - self.n, *tail), dtype=self.dtype, device=probs.device)
            self.state = torch.cat([self.state, pad])
        return self.state

    def update(self, probs: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        """Fold in ``probs [q, n, L, H]`` (or ``[n, L, H]`` for one query)."""
        raise NotImplementedError

    def select(self, keep: torch.Tensor) -> None:
        """Follow an eviction: keep rows `keep` (ascending row indices), in that order."""
        if self.state is not None:
            self.state = self.state[keep]

    def append_rows(self, k: int) -> None:
        """`k` entries joined the row's end without being attended yet (recalled tokens): their
        statistic starts at zero."""
        if self.state is not None and k:
            self.state = torch.cat([self.state, self.state.new_zeros((k, *self.state.shape[1:]))])

    @property
    def stats(self) -> torch.Tensor | None:
        """``[n, L, H]`` float statistic for ``TokenView.attn`` (higher = more important)."""
        return self.state

    def check_integrity(self) -> None:
        if self.state is not None:
            assert self.state.dim() >= 1, f"state shape {tuple(self.state.shape)}"


def _as_block(probs: torch.Tensor, ndim: int = 4) -> torch.Tensor:
    return probs.unsqueeze(0) if probs.dim() == ndim - 1 else probs


class AttentionSum(RowStats):
    """H2O statistic: total attention each token received from all queries so far."""

    def update(self, probs: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        probs = _as_block(probs)
        self.state = attention_sum_update(self._grow(probs), probs)

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.state is not None:
            assert bool((self.state >= 0).all()) and bool(torch.isfinite(self.state).all())


class LastAttention(RowStats):
    """TOVA statistic: the attention of the most recent query."""

    def update(self, probs: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        probs = _as_block(probs)
        self._grow(probs)
        self.state = probs[-1].to(self.dtype)


class LowImportanceCount(RowStats):
    """Scissorhands statistic: minus the number of low-importance steps among the last `history`.

    Args:
        history: window of queries, 1..62 (the register is one int64 per token, layer and head).
        threshold: low importance = attention below ``threshold / num_attended``.
    """

    dtype = torch.int64

    def __init__(self, history: int = 32, threshold: float = 1.0) -> None:
        super().__init__()
        if isinstance(history, bool) or not isinstance(history, int) or not 1 <= history <= 62:
            raise ValueError(f"history must be an integer in [1, 62] (got {history!r})")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0 (got {threshold!r})")
        self.history, self.threshold = history, float(threshold)
        # [L, H] bool: the layers and heads some query scored. A layer left out of `score_layers`
        # is staged as zeros; counted, every zero would be a low-importance step.
        self.observed: torch.Tensor | None = None

    def update(self, probs: torch.Tensor, lengths: torch.Tensor | None = None) -> None:
        probs = _as_block(probs)
        seen = probs.sum(dim=(0, 1)) > 0  # a scored layer's probabilities sum to 1 per query
        self.observed = seen if self.observed is None else self.observed | seen
        self.state = low_importance_update(
            self._grow(probs), probs, self.history, self.threshold, lengths
        )

    @property
    def stats(self) -> torch.Tensor | None:
        """``[n, L, H]`` minus the low-importance count; NaN where no query scored the layer and
        head (`aggregate` leaves those out)."""
        if self.state is None:
            return None
        count = -low_importance_count(self.state, self.history).to(torch.float32)
        return count if self.observed is None else count.masked_fill(~self.observed, torch.nan)

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.state is not None:
            assert bool((self.state >= 0).all() and (self.state < (1 << self.history)).all()), (
                "register bits beyond history"
            )
