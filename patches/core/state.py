"""A request's eviction state: `ReqEvictState`, stored on SGLang's `Req` as `req.vtoken` (read
through `state_of(req)`, None for a request without eviction; `runtime.new_state` builds it).

It composes typed parts; each part is a class of the module of its concern, and only that module
assigns its fields (`tests/runtime/patches/test_state_ownership.py`; the table of parts is in
docs/design/splice.md, "Request state"). `cfg`, `policy`, `rid`, `holed` and `reclaim` never change;
`report` is the request's `meta_info["kv_evict"][0]`. This leaf module imports nothing above it:
a part defined in a higher layer is typed by a Protocol of what the modules use of it (`*Part`
below; `reclaim`, the strategy interface of the step, is typed `Any`), its class named in `PARTS`;
the host-side data the parts hold are the records of `records.py`. The row's coordinates: `row.py`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.policies.base import EvictionPolicy

from .records import Chunk, MovedRow, RetractStash, StepUndo
from .report import Report
from .row import Row

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    from sgl_vtoken.stats import RowStats

    from .sglang_types import RadixTree, Req, TpGroup, TreeNode

# The class of each part defined in a layer above this one, by field: each lives in the module
# that owns it (docs/design/splice.md, "Request state"). They are typed by the Protocols below (or
# `Any`), so that this leaf module imports nothing above it; the ownership lint reads this table.
PARTS = {
    "reclaim": "Reclaim",  # step/reclaim.py
    "stats": "Stats",  # step/scores.py
    "prefix": "Prefix",  # cache/prefix.py
    "naive": "NaiveHold",  # step/held.py
    "retract": "Retraction",  # step/retraction.py
    "prompt": "Prompt",  # step/prefill.py
    "host": "HostChunks",  # cache/host_tier.py
    "recall": "Recall",  # cache/host_recall.py
}


def state_of(req: Req) -> ReqEvictState | None:
    """The eviction state of `req` (an SGLang `Req`), or None when it does not evict."""
    return getattr(req, "vtoken", None)


# What the modules use of each part defined above this layer: mypy checks that each part's class
# (`PARTS`) has it. A member typed `Any` holds a class of a layer above (named in its comment) and
# is assigned through the state by its owner.


class StatsPart(Protocol):
    """`st.stats`, a `step/scores.Stats`."""

    accumulator: RowStats | None
    staged: list[tuple[torch.Tensor, torch.Tensor]]

    def fold(self, tp_group: TpGroup | None = None) -> None: ...

    def snapshot(self) -> torch.Tensor | None: ...

    def restore(self, state: torch.Tensor | None) -> None: ...

    def select(self, keep: torch.Tensor) -> None: ...

    def recalled(self, back: int, n: int) -> None: ...

    def reset(self, policy: EvictionPolicy | None = None) -> None: ...


class ViewHitPart(Protocol):
    """`st.prefix.hit`, a `cache/prefix.ViewHit`."""

    @property
    def node(self) -> TreeNode: ...

    @property
    def slots(self) -> torch.Tensor: ...

    @property
    def copied(self) -> bool: ...


class PrefixPart(Protocol):
    """`st.prefix`, a `cache/prefix.Prefix`."""

    attach: int
    matched: int | None
    restored: TreeNode | None
    restore_blocked: bool

    @property
    def hit(self) -> ViewHitPart | None: ...

    def continue_from(
        self, node: TreeNode | None, slots: torch.Tensor | None, attach: int, copied: bool = False
    ) -> None: ...

    def cap_attach(self, done: int) -> None: ...

    def clear(self) -> None: ...


class NaiveHoldPart(Protocol):
    """`st.naive`, a `step/held.NaiveHold`."""

    held: torch.Tensor
    tree_lock: int
    excess: int
    tree_len: int

    def mark_tree_owned(self, tree_len: int) -> None: ...

    def hold(self, pages: torch.Tensor, tree_lock: int, excess: int) -> None: ...

    def release(self) -> torch.Tensor: ...

    def reset(self) -> None: ...


class RetractionPart(Protocol):
    """`st.retract`, a `step/retraction.Retraction`."""

    stash: RetractStash | None
    resume_node: TreeNode | None
    real_outputs: array | None
    undo: StepUndo | None
    resume_prefill: bool
    retractions: int
    blocked: bool

    def start_step(self, stats: torch.Tensor | None) -> None: ...

    def resume(
        self,
        tree: RadixTree,
        req: Req,
        st: ReqEvictState,
        logical: array,
        limit: int,
        result: MatchResult,
    ) -> MatchResult: ...

    def drop(self) -> None: ...

    def save_victims(self, moved: MovedRow) -> None: ...

    def save_undo(
        self, slots: torch.Tensor, positions: torch.Tensor, row: Row, report: Report
    ) -> None: ...

    def lose_undo(self) -> None: ...

    def restore_outputs(self, req: Req) -> None: ...


class PromptPart(Protocol):
    """`st.prompt`, a `step/prefill.Prompt`."""

    logical: array | None
    prefill_evicted: int
    whole: bool

    def logical_ids(self, req: Req) -> array: ...

    def adopt(self, req: Req, prompt: array) -> None: ...

    def row_ids(self, req: Req, ids: array) -> None: ...

    def restore(self, req: Req) -> bool: ...

    def reset(self) -> None: ...

    def split(self) -> None: ...

    def decide_whole(self, st: ReqEvictState, req: Req, pool_tokens: int) -> None: ...


class HostChunksPart(Protocol):
    """`st.host`, a `cache/host_tier.HostChunks`."""

    chunks: list[Chunk]
    taken: bool

    def take(self) -> list[Chunk]: ...


class RecallPart(Protocol):
    """`st.recall`, a `cache/host_recall.Recall`."""

    plan: Any  # a cache/host_recall.RecallPlan, or None
    pinned: torch.Tensor | None
    planned: bool

    def reset(self, unpin: bool = False) -> None: ...

    def rematch(self) -> None: ...


@dataclass
class ReqEvictState:
    """Per-request eviction state, stored on the SGLang `Req` as `req.vtoken`: the settings, the
    report and the parts (module docstring)."""

    cfg: EvictConfig
    policy: EvictionPolicy
    rid: int  # stable 32-bit identity (seeded policies)
    holed: bool  # served by the holed radix cache (radix.tree_mode)
    reclaim: Any  # how its row gives memory back: a step/reclaim.Reclaim (PARTS)
    report: Report  # meta_info["kv_evict"][0] (`Report.as_dict`)
    row: Row
    stats: StatsPart
    prefix: PrefixPart
    naive: NaiveHoldPart
    retract: RetractionPart
    prompt: PromptPart
    host: HostChunksPart
    recall: RecallPart

    def restore_prompt(self, req: Req) -> bool:
        """Back to the logical ids: a request holding row coordinates (a stored view's ids, or
        a prefill's kept entries) gets its logical prompt back (fill ids refreshed) and continues
        from no view, its row positions from 0. Returns whether it held row coordinates."""
        if not self.prompt.restore(req):
            return False
        self.prefix.clear()
        self.recall.rematch()
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
