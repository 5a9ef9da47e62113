"""TokenView: what a policy sees of one request's row, built cheaply by the caller every step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenView:
    """One request's live tokens in row order; every tensor's first dimension is `n`.

    Only shapes are checked on construction (no device sync); :meth:`check` also checks values.

    Attributes:
        positions: ``[n] int64`` logical (original RoPE) positions, distinct; ascending, except
            in a recalling turn's row, whose recalled entries follow the rest.
        keys: ``[n, L, H, D]`` cached keys (post-RoPE), or None if the policy does not read keys.
        attn: ``[n, L, H]`` float attention statistic produced by the policy's accumulator
            (higher = more important), or None.
        shared: ``[n] bool`` True for tokens the request does not own (tree-owned prefix, or read
            by another request); None means all private.
        agreed: ``[n] bool`` True for shared tokens every holder has agreed to drop (used by the
            sharing-aware wrapper in ``consensus`` mode); None means no agreement.
        rid: stable integer identity of the request (see :func:`sgl_vtoken.rng.stable_id`).
        step: the request's eviction counter; seeded policies hash (seed, rid, step, position).
        units: ``[n] int64`` the position of each token's unit's first token
            (`sgl_vtoken.units`), read by policies with a `span`; None: no units.
    """

    positions: torch.Tensor
    keys: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    agreed: torch.Tensor | None = None
    rid: int = 0
    step: int = 0
    units: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.positions.dim() != 1:
            raise ValueError(
                f"TokenView.positions must be 1-D [n] (got {tuple(self.positions.shape)})"
            )
        n = self.positions.shape[0]
        for name, dims in (
            ("keys", 4),
            ("attn", 3),
            ("shared", 1),
            ("agreed", 1),
            ("units", 1),
        ):
            t = getattr(self, name)
            if t is not None and (t.dim() != dims or t.shape[0] != n):
                raise ValueError(
                    f"TokenView.{name} must have {dims} dims and first dim n={n} "
                    f"(got {tuple(t.shape)})"
                )

    @property
    def n(self) -> int:
        return self.positions.shape[0]

    def require(self, name: str) -> torch.Tensor:
        """The statistic `name` (``"keys"``, ``"attn"``) a policy `needs`.

        Raises:
            ValueError: the caller did not collect it (None).
        """
        t = getattr(self, name)
        if t is None:
            raise ValueError(
                f"a policy needs TokenView.{name} (got None); the server must collect it"
            )
        return t


@dataclass(frozen=True)
class RowBatch:
    """The rows of one eviction step, padded to the longest (`W`), for a policy's `score_rows`.

    Attributes:
        positions: ``[B, W] int64`` logical positions (padding entries hold 0).
        valid: ``[B, W] bool`` True for live row entries.
        rids, steps: ``[B] int64`` request identities and eviction counters (seeded policies).
        key_norms: returns ``[B, W, L, H] float32``, the L2 norm of every cached key (computed on
            the pool's device, every KV head), or None when the step has no pool to read.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    rids: torch.Tensor
    steps: torch.Tensor
    key_norms: Callable[[], torch.Tensor] | None = None
