"""A request's eviction state: one object, stored on SGLang's `Req` as `req.vtoken`.

Read it through `state_of(req)` (None for a request without eviction). Every change to it from
another module is a method of `ReqEvictState` whose docstring states its contract; fields are
read freely. This module imports nothing else of `patches/` but `tp.py`, so every other module
may import it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.policies import policy_from_config
from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.rng import stable_id

from .tp import tp_gather


def state_of(req) -> ReqEvictState | None:
    """The eviction state of `req` (an SGLang `Req`), or None when it does not evict."""
    return getattr(req, "vtoken", None)


@dataclass
class ReqEvictState:
    """Per-request eviction state, stored on the SGLang `Req` as `req.vtoken`."""

    cfg: EvictConfig
    policy: EvictionPolicy
    rid: int                                   # stable 32-bit identity (seeded policies)
    kept_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    offset: int = 0                            # tokens evicted so far: logical - row position
    steps: int = 0                             # evictions so far (seeded policies hash it)
    pages_freed: int = 0
    naive_pages: list[int] = field(default_factory=list)  # pages held back in naive mode
    report: dict = field(default_factory=dict)  # meta_info["kv_evict"][0], updated in place
    accumulator: object = None                 # attention statistics (H2O, TOVA, Scissorhands)
    staged: list = field(default_factory=list)  # ([q, n, layers, kv_heads], [q] lengths) per forward
    holed: bool = False                        # served by the holed radix cache (radix.tree_mode)
    logical_prompt: array | None = None        # the prompt's ids while the request holds a view's
    hit: tuple | None = None                   # (node, slots, copied) of the stored view it continues
    attach: int = 0                            # logical prefix whose KV is hole-free, full attention
    tree_len: int = 0                          # positions below were tree-owned at the first eviction
    tree_lock: int = 0                         # Naive-Evict: tree tokens its lock still covers
    naive_excess: int = 0                      # Naive-Evict: pages held beyond its true footprint
    stash: object = None                       # retraction.RetractStash while retracted (page size 1)
    resume_node: object = None                 # the radix node its stash was written back to
    real_outputs: object = None                # a resumed request's outputs while its prefill is set up
    undo: tuple | None = None                  # this step's state before its fold and eviction
    resume_prefill: bool = False               # its prefill is a resume's (the row ends there)
    retractions: int = 0
    blocked: bool = False                      # retracted, and its view does not fit the pool yet
    prefill_evicted: int = 0                   # prompt tokens evicted during its prefill (prefill_chunk)
    host: list = field(default_factory=list)   # host_tier.Chunk it holds: its history's, then its own
    host_taken: bool = False                   # it took its view's host store (admission or first prefill forward)
    recall: object = None                      # host_tier.RecallPlan until its prefill's first chunk ends
    pinned: torch.Tensor | None = None         # positions recalled this turn: kept like sinks

    def logical_ids(self, req) -> array:
        """The request's logical token ids (prompt + output), whatever its row holds."""
        prompt = req.origin_input_ids if self.logical_prompt is None else self.logical_prompt
        return array("q", prompt) + array("q", req.output_ids)

    def positions(self, row_len: int) -> torch.Tensor:
        """``[row_len] int64`` logical position of every live row entry."""
        m = self.kept_pos.numel()
        return torch.cat([self.kept_pos[:row_len], torch.arange(m, row_len) + self.offset])

    # --- a decode step (eviction.py) ---------------------------------------------------------
    def start_step(self) -> None:
        """A decode step starts for this request (before its fold and eviction): a resumed view is
        its row now (the stash is dropped), and the statistics as they are now are remembered for
        `undo_step` (a reference: statistics are replaced, never written in place)."""
        self.stash, self.resume_prefill = None, False
        self.undo = (self.accumulator.state if self.accumulator is not None else None, None)

    def stage(self, block: torch.Tensor, lengths: torch.Tensor) -> None:
        """Queue one forward's ``[q, n, layers, kv_heads]`` attention probabilities (query j saw
        ``lengths[j]`` keys) for the next `fold_staged` (`scores.prepare` allocates, the attention
        layers fill it)."""
        self.staged.append((block, lengths))

    def fold_staged(self, tp_group=None) -> None:
        """Fold the staged probabilities into the accumulator, oldest block first (eviction hook,
        step start). With tensor parallelism every rank folds every rank's KV heads."""
        for block, lengths in self.staged:
            self.accumulator.update(tp_gather(block, tp_group, dim=-1), lengths)
        self.staged.clear()

    def mark_tree_owned(self, tree_len: int) -> None:
        """First eviction under the holed cache: the row's first `tree_len` positions are
        tree-owned (the shared prompt), which Naive-Evict accounting needs later."""
        self.tree_len = tree_len

    def save_undo(self, row: torch.Tensor, positions: torch.Tensor) -> None:
        """Before an eviction (holed, page size 1): remember the row (`row` slots at logical
        `positions`) and the figures the eviction changes, for `undo_step`."""
        self.undo = (self.undo[0], (row, positions, self.steps, self.kept_pos, self.offset,
                                    dict(self.report), self.pages_freed))

    def select_stats(self, keep: torch.Tensor) -> None:
        """The statistics follow the row: keep those of the row entries `keep` (any device)."""
        if self.accumulator is not None and self.accumulator.state is not None:
            self.accumulator.select(keep.to(self.accumulator.state.device))

    def count_freed(self, pages: int) -> None:
        """`pages` of the request's KV went back to the pool outside an eviction plan (its stored
        history's slots only it reached); the report picks them up at `record_eviction`."""
        self.pages_freed += pages

    def hold_naive(self, pages: list[int], tree_lock: int, excess: int) -> None:
        """Naive-Evict emulation (`held.py`): the request now holds back `pages` (page ids), its
        lock covers the first `tree_lock` tree tokens, `excess`: pages held beyond Naive-Evict's."""
        self.naive_pages, self.tree_lock, self.naive_excess = pages, tree_lock, excess

    def release_naive(self) -> list[int]:
        """The pages held back, which the caller returns to the pool; none are held after."""
        pages, self.naive_pages = self.naive_pages, []
        return pages

    def record_eviction(self, kept_pos: torch.Tensor, evicted: int, pages_freed: int) -> None:
        """An eviction left the row holding the entries at logical `kept_pos` (ascending, one per
        row entry), `evicted` tokens fewer, and returned `pages_freed` pages: positions, counts
        and the report follow (the server's counters are the caller's)."""
        self.kept_pos = kept_pos
        self.offset += evicted
        self.steps += 1
        self.pages_freed += pages_freed
        self.report.update(evicted_tokens=self.report["evicted_tokens"] + evicted,
                           live_tokens=int(kept_pos.numel()), pages_freed=self.pages_freed,
                           evictions=self.steps)

    def undo_step(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A retraction drops this step: the statistics go back to its start (`start_step`) and
        its eviction, if any, is undone (`save_undo`). Returns the row before that eviction,
        ``(slots, positions)``, or None when the step did not evict."""
        if self.undo is None:
            return None
        stats, before = self.undo
        if self.accumulator is not None:
            self.accumulator.state = stats
        if before is None:
            return None
        slots, positions, self.steps, self.kept_pos, self.offset, report, self.pages_freed = before
        self.report.update(report)
        return slots, positions

    def recalled_into_row(self, req, recalled: torch.Tensor, back: int, resume: int, ids: array) -> None:
        """Between a recalling turn's prefill chunks (`host_tier.recall_prompt`): the row keeps its
        first `back` entries, then the tokens recalled at logical `recalled`, kept for the rest of
        the turn (`pinned`); the next chunk continues at logical position `resume`. `ids`: the
        request's ids in row coordinates (its logical prompt is kept for `restore_prompt`)."""
        n = recalled.numel()
        self.kept_pos = torch.cat([self.positions(back), recalled.cpu()])
        self.offset = resume - (back + n)
        self.pinned = recalled.cpu().clone()
        if self.accumulator is not None and self.accumulator.state is not None:
            self.accumulator.select(torch.arange(back, device=self.accumulator.state.device))
            self.accumulator.append_rows(n)
        self.row_ids(req, ids)
        self.report["pinned_tokens"] = n

    # --- stored views and retraction (radix.py, history.py, retraction.py) ----------------------
    def adopt_view(self, req, positions: torch.Tensor, depth: int, prompt: array,
                   outputs: array | None = None) -> None:
        """`req` continues from a stored view: a row whose live entries sit at logical `positions`
        and cover the first `depth` logical tokens. Its ids become row coordinates, `prompt` (and
        `outputs`); its logical prompt is kept for `restore_prompt`; its row positions continue at
        `depth`. Without `outputs`: a turn extending a stored history (reported as
        `history_tokens`, `history_view_tokens`). With them: a retracted request resuming from its
        stash, whose real outputs are kept aside until its prefill is set up (`prefill_set_up`)."""
        self.logical_prompt = req.origin_input_ids
        req.origin_input_ids = prompt
        if outputs is None:
            req.refresh_fill_ids()
            self.report.update(history_tokens=depth, history_view_tokens=len(positions))
        else:
            self.real_outputs, req.output_ids = req.output_ids, outputs
            req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids
        self.kept_pos, self.offset = positions.clone().cpu(), depth - len(positions)

    def continue_from(self, node, slots: torch.Tensor | None, attach: int, copied: bool = False) -> None:
        """The row starts as the stored view at radix `node`, whose KV is at `slots` (`node` None:
        no view, a plain prefill); `attach`: the logical prefix whose KV is hole-free; `copied`:
        `slots` end in the request's own copy of the view's partial last page (page size > 1)."""
        self.hit = None if node is None else (node, slots, copied)
        self.attach = attach

    def evicts_in_prefill(self, req) -> bool:
        """Whether `req`'s prefill is evicted in chunks (`prefill_chunk`): a prompt's, not the
        re-prefill of a retracted request's outputs."""
        return self.cfg.prefill_peak is not None and not req.output_ids

    def row_ids(self, req, ids: array) -> None:
        """`req`'s ids become the row coordinates `ids` (fill ids refreshed); its logical prompt
        is kept for `restore_prompt` the first time."""
        if self.logical_prompt is None:
            self.logical_prompt = req.origin_input_ids
        req.origin_input_ids = ids
        req.refresh_fill_ids()

    def compact_prompt(self, req, prompt: array, evicted: int) -> None:
        """An eviction during the prefill (`prefill.py`) removed `evicted` prefilled prompt
        tokens: `req`'s ids become row coordinates `prompt` (the kept entries' ids, then the
        prompt's remaining ids); its logical prompt is kept for `restore_prompt`."""
        self.row_ids(req, prompt)
        self.prefill_evicted += evicted
        self.report["prefill_evicted_tokens"] = self.prefill_evicted

    def restore_prompt(self, req) -> bool:
        """Back to the logical ids: a request holding a stored view's ids (`adopt_view`) gets its
        logical prompt back (fill ids refreshed) and continues from no view, its row positions
        from 0. Returns whether it held a view."""
        if self.logical_prompt is None:
            return False
        req.origin_input_ids, self.logical_prompt, self.hit, self.recall = self.logical_prompt, None, None, None
        self.kept_pos, self.offset = self.kept_pos[:0], 0
        req.refresh_fill_ids()
        return True

    def restore_outputs(self, req) -> None:
        """A resumed request gets its real outputs back (its prefill is set up, or it was not
        admitted this round); its prompt stays in row coordinates."""
        if self.real_outputs is not None:
            req.output_ids, self.real_outputs = self.real_outputs, None
            req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids

    def prefill_set_up(self, req) -> None:
        """SGLang set up its prefill: a resumed request gets its real outputs back, and that
        prefill is a resume's (its row ends there; `scores.prepare`)."""
        if self.real_outputs is not None:
            self.restore_outputs(req)
            self.resume_prefill = True

    def retracted(self, stash) -> None:
        """SGLang retracts the request: it will resume from `stash` (its row before this step,
        `retraction.RetractStash`; counted in `retractions`), or, with None, be re-prefilled
        with full attention, which the report says (`retracted_reprefill`)."""
        if stash is None:
            self.report["retracted_reprefill"] = True
        else:
            self.retractions += 1
            self.stash = stash

    def stash_in_tree(self, node) -> None:
        """Its stash is held by radix `node`, or (None) the pool cannot hold it yet: `blocked`,
        the request is not admitted this round."""
        self.resume_node, self.blocked = node, node is None

    def reset(self) -> None:
        """Retraction: the row is gone, and the view it continued with it. With a stash the request
        resumes from it (the policy state stays); without one it is re-prefilled from its ids and
        every eviction is forgotten."""
        self.hit, self.recall = None, None
        self.kept_pos = self.kept_pos[:0]
        self.offset = self.prefill_evicted = 0
        self.report.pop("prefill_evicted_tokens", None)
        self.tree_len = self.tree_lock = self.naive_excess = 0
        self.staged.clear()
        if self.stash is None:
            self.steps = 0
            self.accumulator = self.policy.new_accumulator()
            self.pinned = None


def new_state(cfg: EvictConfig, rid: str, holed: bool) -> ReqEvictState:
    """Fresh state of a request `rid` evicting under `cfg`; `holed`: served by the holed radix
    cache's paths (`radix.tree_mode(cfg)`)."""
    policy = policy_from_config(cfg)
    st = ReqEvictState(cfg=cfg, policy=policy, rid=stable_id(rid), accumulator=policy.new_accumulator(),
                       holed=holed)
    st.report.update(policy=cfg.policy, budget=cfg.budget, evicted_tokens=0, live_tokens=None,
                     pages_freed=0, evictions=0)
    return st
