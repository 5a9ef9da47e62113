"""The host-side records a request's state holds for the layers above (`core/state.py` types its
parts with them): a `Chunk` of evicted tokens' K/V (the host tier's unit, `cache/host_tier.py`),
and what a retraction resumes from (`step/retraction.py`): the stash of a retracted row and the
undo of the step that evicted before it."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .report import Report
from .row import Row


@dataclass(eq=False)
class Chunk:
    """Victims of one eviction of one row: ``positions [m] int64``, ``k, v [m, layers, H, D]``
    (host tensors, pinned on CUDA), how many owners hold it, and the event after which `k` and
    `v` hold the values (None: they do)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    refs: int = 0
    ready: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def wait(self) -> Chunk:
        """Wait for its copy to the host (once); returns itself."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


@dataclass(frozen=True)
class RetractStash:
    """A retracted request's compacted row, on the host.

    Attributes:
        ids: logical token ids with KV (prompt + outputs but the last), `[depth]`.
        positions: ``[n] int64`` logical positions of the live row entries, ascending.
        keys, values: ``[layers, n, kv_heads, head_dim]`` cached K/V of those entries (CPU).
        namespace: radix-cache namespace of the resumed view, unique to this retraction.
    """

    ids: array
    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    namespace: str

    @property
    def depth(self) -> int:
        return len(self.ids)


class MovedRow(NamedTuple):
    """Page size > 1, overlap scheduler: what of the row before this step's eviction the repack
    did not keep in place. Its kept entries are the row's first ``keep.sum()`` entries after the
    step, in order; its victims' K/V were copied before the repack wrote over them."""

    keep: torch.Tensor  # [n] bool (host): the row before's entries kept
    keys: torch.Tensor  # [layers, victims, kv_heads, head_dim] the victims' K/V, row order
    values: torch.Tensor


class RowBefore(NamedTuple):
    """The row before this step's eviction: its ``slots`` and ``positions`` ``[n] int64``, the
    row's positions and counts (`Row.snapshot`), a copy of the report, and at page size > 1 where
    its entries are now (`moved`; page size 1: the slots themselves, freed but not reused)."""

    slots: torch.Tensor
    positions: torch.Tensor
    row: Row
    report: Report
    moved: MovedRow | None = None


class StepUndo(NamedTuple):
    """This step's state before its fold and eviction: the statistics (`Stats.snapshot`) and,
    when it evicted, the row before (holed cache), or `lost`: it evicted and the row before is
    gone (page size > 1 without the overlap scheduler, where no retraction needs it). `victims`:
    the moved row's part saved before the repack, until `save_undo` takes it."""

    stats: torch.Tensor | None
    before: RowBefore | None = None
    lost: bool = False
    victims: MovedRow | None = None
