"""Sharing-aware wrapper: never evict what the request does not own alone.

Like kvpress's composing presses (AdaKVPress, ComposedPress), it wraps any policy. Tokens marked
``TokenView.shared`` (the tree-owned prefix ``[0, cpl)`` or a slot another request reads) are
added to the must-keep set. In ``consensus`` mode a shared token may go when
``TokenView.agreed`` says every holder has agreed to drop it::

    | shared (tree-owned) prefix: kept | private: the inner policy chooses |
    0                                 cpl                                 len
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.stats import RowStats
from sgl_vtoken.types import RowBatch, TokenView

MODES = ("never", "consensus")


class SharingAware(EvictionPolicy):
    """Wraps `inner`; shared tokens join the must-keep set (sinks, window).

    Args:
        inner: the policy that scores tokens.
        mode: ``"never"`` keeps every shared token; ``"consensus"`` keeps shared tokens unless
            ``view.agreed`` marks them.

    Raises (from :meth:`keep`):
        ValueError: budget smaller than shared + sinks + window.
    """

    def __init__(self, inner: EvictionPolicy, mode: str = "never") -> None:
        if not isinstance(inner, EvictionPolicy):
            raise TypeError(f"SharingAware.inner must be an EvictionPolicy (got {inner!r})")
        if mode not in MODES:
            raise ValueError(f"SharingAware.mode must be one of {list(MODES)} (got {mode!r})")
        self.inner, self.mode = inner, mode

    def __repr__(self) -> str:
        return f"SharingAware({self.inner!r}, mode={self.mode!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharingAware) and (self.inner, self.mode) == (
            other.inner,
            other.mode,
        )

    # Everything but the must-keep set is the inner policy's.
    name = property(lambda self: f"{self.inner.name}+sharing")
    needs = property(lambda self: self.inner.needs)
    accumulator = property(lambda self: self.inner.accumulator)
    sink = property(lambda self: self.inner.sink)
    window = property(lambda self: self.inner.window)
    aggregation = property(lambda self: self.inner.aggregation)
    span = property(lambda self: self.inner.span)

    def score(self, view: TokenView) -> torch.Tensor:
        return self.inner.score(view)

    def score_rows(self, batch: RowBatch) -> torch.Tensor | None:
        return self.inner.score_rows(batch)

    def must_keep(self, view: TokenView) -> torch.Tensor:
        must = self.inner.must_keep(view)
        if view.shared is None:
            return must
        shared = view.shared
        if self.mode == "consensus" and view.agreed is not None:
            shared = shared & ~view.agreed
        return must | shared

    def new_accumulator(self, **kwargs: Any) -> RowStats | None:
        return self.inner.new_accumulator(**kwargs)
