"""The policy interface: score a request's tokens, keep the `budget` best, protect sinks and window.

A policy only answers *which* tokens survive; it never sees slots or pages (the planner does).
Subclasses implement :meth:`EvictionPolicy.score` (higher = keep) and nothing else::

    row (n live tokens, positions ascending)
    | sinks: pos < sink | ........ scored, top (budget - protected) kept ........ | window |
    keep(view, budget) -> ascending row indices, min(n, budget) of them (fewer with a `span`:
                          a word or number kept in part is dropped, `sgl_vtoken.selection`)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sgl_vtoken.selection import check_budget, must_keep, select
from sgl_vtoken.stats import RowStats
from sgl_vtoken.types import RowBatch, TokenView

AGGREGATIONS = ("sum", "max")


def aggregate(stats: torch.Tensor, how: str) -> torch.Tensor:
    """Reduce per-layer / per-head statistics ``[n, ...]`` to one float64 score per token ``[n]``.

    One slot holds every layer and head of a token, so a keep/evict decision must be per token:
    ``sum`` ranks by total (equivalently mean) importance, ``max`` keeps a token any head needs.
    NaN marks a layer and head the statistic did not observe: both leave it out.
    """
    flat = stats.reshape(stats.shape[0], -1).to(torch.float64)
    if how == "sum":
        return flat.nansum(dim=1)
    if how == "max":
        if not flat.shape[1]:
            return flat.sum(dim=1)
        return torch.where(flat.isnan(), -torch.inf, flat).amax(dim=1)
    raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)} (got {how!r})")


def smooth(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Mean of each score with its row neighbours, ``kernel // 2`` on each side (SnapKV's
    pooling, arXiv:2404.14469): a kept token tends to keep its neighbours, so a span the
    statistic only partly marks (the digits of a number) survives whole. ``[n]`` in and out."""
    if kernel <= 1 or scores.numel() == 0:
        return scores
    x = scores.to(torch.float64)[None, None]
    return torch.nn.functional.avg_pool1d(
        x, kernel, stride=1, padding=kernel // 2, count_include_pad=False
    )[0, 0]


@dataclass
class EvictionPolicy:
    """Base class. Fields are hyperparameters; `sink`, `window`, `aggregation` are shared by all.

    Attributes:
        sink: tokens with position < sink are always kept (attention sinks).
        window: the last `window` rows (most recent tokens) are always kept.
        aggregation: ``"sum"`` or ``"max"`` over layers and heads (attention and key policies).
        span: span-aware keeping: words and digit runs of up to `span` tokens are kept or
            dropped whole (``TokenView.units``, `sgl_vtoken.units`); 0: off.
    """

    sink: int = 4
    window: int = 0
    aggregation: str = "sum"
    span: int = 0

    name: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()  # TokenView fields the policy reads: "keys", "attn"
    accumulator: ClassVar[type | None] = None  # stats class feeding TokenView.attn

    def __post_init__(self) -> None:
        for f in ("sink", "window", "span"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{type(self).__name__}.{f} must be an integer >= 0 (got {v!r})")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"{type(self).__name__}.aggregation must be one of "
                f"{list(AGGREGATIONS)} (got {self.aggregation!r})"
            )

    def score(self, view: TokenView) -> torch.Tensor:
        """``[n]`` float scores, higher = keep. Protected tokens are handled by the caller."""
        raise NotImplementedError

    def score_rows(self, batch: RowBatch) -> torch.Tensor | None:
        """``[B, W]`` scores of a whole step's rows at once (padding ignored), equal element for
        element to :meth:`score` of each row; None (the default) scores row by row."""
        return None

    def protected(self, view: TokenView) -> torch.Tensor:
        """``[n] bool``: tokens kept regardless of score (sinks and the recent window)."""
        one = functools.partial(torch.full, (1,), dtype=torch.int64, device=view.positions.device)
        return must_keep(view.positions[None], one(view.n), one(self.sink), one(self.window))[0]

    def must_keep(self, view: TokenView) -> torch.Tensor:
        return self.protected(view)

    def keep(self, view: TokenView, budget: int) -> torch.Tensor:
        """Ascending ``int64`` row indices of the tokens to keep (``min(n, budget)``, fewer when a
        `span` drops a unit kept in part): `score`, then `sgl_vtoken.selection.select` on a batch
        of one (the batched step's rule).

        Raises:
            ValueError: if the tokens that must be kept outnumber `budget`, or a needed statistic
                is missing from `view`.
        """
        for need in self.needs:
            if getattr(view, need) is None:
                raise ValueError(
                    f"policy {self.name!r} needs TokenView.{need} "
                    f"(got None); the server must collect it for this policy"
                )
        units = view.require("units")[None] if self.span else None
        n, dev = view.n, view.positions.device
        if n <= budget:
            return torch.arange(n, device=dev)
        one = functools.partial(torch.full, (1,), dtype=torch.int64, device=dev)
        sel = select(self.score(view)[None], self.must_keep(view)[None], one(budget), one(n), units)
        check_budget(sel.over.tolist(), [budget], [self.name])
        return sel.keep[0].nonzero().flatten()

    def new_accumulator(self, **kwargs: Any) -> RowStats | None:
        """A fresh per-request statistics accumulator, or None if the policy needs none."""
        return None if self.accumulator is None else self.accumulator(**kwargs)


@dataclass
class AttentionPolicy(EvictionPolicy):
    """Shared score of the attention policies (H2O, TOVA, Scissorhands): their accumulated
    statistic, aggregated over layers and heads, smoothed over `pool` row neighbours (1: off;
    the default 5 is SnapKV's kernel: the digits of a number the statistic only partly marks
    survive together, docs/RESULTS.md "Defaults that keep answers")."""

    pool: int = 5
    needs: ClassVar[tuple[str, ...]] = ("attn",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.pool, bool)
            or not isinstance(self.pool, int)
            or self.pool < 1
            or self.pool % 2 == 0
        ):
            raise ValueError(
                f"{type(self).__name__}.pool must be an odd integer >= 1 (got {self.pool!r})"
            )

    def score(self, view: TokenView) -> torch.Tensor:
        return smooth(aggregate(view.require("attn"), self.aggregation), self.pool)
