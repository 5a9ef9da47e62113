"""A request's eviction state: `ReqEvictState`, stored on SGLang's `Req` as `req.vtoken` (read
through `state_of(req)`, None for a request without eviction; `runtime.new_state` builds it).

It composes typed parts; each part is a class of the module of its concern, and only that module
assigns its fields (`tests/runtime/patches/test_state_ownership.py`; the table of parts is in
docs/design.md, "Request state"). `cfg`, `policy`, `rid`, `holed` and `reclaim` never change;
`report` is the request's `meta_info["kv_evict"][0]`. This leaf module imports nothing above it:
the parts defined in higher layers are typed `Any`, their classes named in `PARTS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.policies.base import EvictionPolicy

from .report import Report

# The class of each part defined in a layer above this one, by field: each lives in the module
# that owns it (docs/design.md, "Request state"). They are typed `Any` below, so that this leaf
# module imports nothing above it; the ownership lint reads this table.
PARTS = {
    "reclaim": "Reclaim",  # step/reclaim.py
    "stats": "Stats",  # step/scores.py
    "prefix": "Prefix",  # cache/radix.py
    "naive": "NaiveHold",  # step/held.py
    "retract": "Retraction",  # step/retraction.py
    "prompt": "Prompt",  # step/prefill.py
    "host": "HostChunks",  # cache/host_tier.py
    "recall": "Recall",  # cache/host_recall.py
}


def state_of(req) -> ReqEvictState | None:
    """The eviction state of `req` (an SGLang `Req`), or None when it does not evict."""
    return getattr(req, "vtoken", None)


@dataclass
class Row:
    """Where the row's entries sit in the logical sequence: entry j is at ``kept_pos[j]`` for the
    entries the last eviction kept, at ``j + offset`` after them."""

    kept_pos: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, dtype=torch.int64)
    )  # [m] int64, CPU
    offset: int = 0  # tokens evicted so far: logical - row position
    steps: int = 0  # evictions so far (seeded policies hash it)
    freed: int = 0  # pages of its KV freed so far

    def positions(self, row_len: int) -> torch.Tensor:
        """``[row_len] int64`` logical position of every live row entry."""
        m = self.kept_pos.numel()
        return torch.cat([self.kept_pos[:row_len], torch.arange(m, row_len) + self.offset])

    def record(self, kept_pos: torch.Tensor, evicted: int, pages: int) -> None:
        """An eviction left the row holding the entries at logical `kept_pos` (ascending, one per
        row entry), `evicted` tokens fewer, and returned `pages` pages to the pool."""
        self.kept_pos, self.offset = kept_pos, self.offset + evicted
        self.steps += 1
        self.freed += pages

    def count_freed(self, pages: int) -> None:
        """`pages` of the request's KV went back to the pool outside an eviction plan (its stored
        history's slots only it reached)."""
        self.freed += pages

    def start_at(self, positions: torch.Tensor, depth: int) -> None:
        """The row is a stored view whose entries sit at logical `positions` (any device) and
        cover the first `depth` logical tokens; the entries after them continue at `depth`."""
        self.kept_pos, self.offset = positions.clone().cpu(), depth - len(positions)

    def keep(self, kept_pos: torch.Tensor, dropped: int) -> None:
        """Entries left the row outside an eviction (a turn's recalled tokens, at its end): it
        holds the entries at logical `kept_pos`, `dropped` entries fewer; counts unchanged."""
        self.kept_pos, self.offset = kept_pos, self.offset + dropped

    def join(self, back: int, recalled: torch.Tensor, resume: int) -> None:
        """Recall: the row keeps its first `back` entries, then entries at logical `recalled`
        ``[n] int64``; the entries after them continue at logical position `resume`."""
        self.kept_pos = torch.cat([self.positions(back), recalled.cpu()])
        self.offset = resume - (back + recalled.numel())

    def clear(self, forget: bool) -> None:
        """The row starts over from logical position 0; `forget`: its evictions are forgotten."""
        self.kept_pos, self.offset = self.kept_pos[:0], 0
        if forget:
            self.steps = 0

    def snapshot(self) -> Row:
        """A copy of the positions and counts, for `restore` (tensors are replaced, never written
        in place)."""
        return replace(self)

    def restore(self, saved: Row) -> None:
        """Back to the positions and counts of `saved` (`snapshot`)."""
        self.kept_pos, self.offset, self.steps, self.freed = (
            saved.kept_pos,
            saved.offset,
            saved.steps,
            saved.freed,
        )


@dataclass
class ReqEvictState:
    """Per-request eviction state, stored on the SGLang `Req` as `req.vtoken`: the settings, the
    report and the parts (module docstring)."""

    cfg: EvictConfig
    policy: EvictionPolicy
    rid: int  # stable 32-bit identity (seeded policies)
    holed: bool  # served by the holed radix cache (radix.tree_mode)
    reclaim: Any  # how its row gives memory back (PARTS)
    report: Report  # meta_info["kv_evict"][0] (`Report.as_dict`)
    row: Row
    stats: Any
    prefix: Any
    naive: Any
    retract: Any
    prompt: Any
    host: Any
    recall: Any

    def restore_prompt(self, req) -> bool:
        """Back to the logical ids: a request holding row coordinates (a stored view's ids, or
        a prefill's kept entries) gets its logical prompt back (fill ids refreshed) and continues
        from no view, its row positions from 0. Returns whether it held row coordinates."""
        if not self.prompt.restore(req):
            return False
        self.prefix.clear()
        self.recall.reset()
        self.row.clear(forget=False)
        return True

    def reset(self) -> None:
        """Retraction: the row is gone, and the view it continued with it. With a stash the request
        resumes from it (the policy state stays); without one it is re-prefilled from its ids and
        every eviction is forgotten."""
        forget = self.retract.stash is None
        self.prefix.clear()
        self.recall.reset(unpin=forget)
        self.row.clear(forget)
        self.prompt.reset()
        self.report.evicted_in_prefill(None)
        self.naive.reset()
        self.stats.reset(self.policy if forget else None)
