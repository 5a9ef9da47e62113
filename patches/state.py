"""A request's eviction state: one object, stored on SGLang's `Req` as `req.vtoken`.

Read it through `state_of(req)` (None for a request without eviction). Every change to it from
another module is a method of `ReqEvictState` whose docstring states its contract; fields are
read freely. This module imports nothing else of `patches/`, so every other module may import it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.policies import policy_from_config
from sgl_vtoken.policies.base import EvictionPolicy
from sgl_vtoken.rng import stable_id


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
    hit: tuple | None = None                   # (node, slots) of the stored view it continues
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

    def logical_ids(self, req) -> array:
        """The request's logical token ids (prompt + output), whatever its row holds."""
        prompt = req.origin_input_ids if self.logical_prompt is None else self.logical_prompt
        return array("q", prompt) + array("q", req.output_ids)

    def positions(self, row_len: int) -> torch.Tensor:
        """``[row_len] int64`` logical position of every live row entry."""
        m = self.kept_pos.numel()
        return torch.cat([self.kept_pos[:row_len], torch.arange(m, row_len) + self.offset])

    def reset(self) -> None:
        """Retraction: the row is gone. With a stash the request resumes from it (the policy state
        stays); without one it is re-prefilled from its ids and every eviction is forgotten."""
        self.kept_pos = self.kept_pos[:0]
        self.offset = 0
        self.tree_len = self.tree_lock = self.naive_excess = 0
        self.staged.clear()
        if self.stash is None:
            self.steps = 0
            self.accumulator = self.policy.new_accumulator()


def new_state(cfg: EvictConfig, rid: str, holed: bool) -> ReqEvictState:
    """Fresh state of a request `rid` evicting under `cfg`; `holed`: served by the holed radix
    cache's paths (`radix.tree_mode(cfg)`)."""
    policy = policy_from_config(cfg)
    st = ReqEvictState(cfg=cfg, policy=policy, rid=stable_id(rid), accumulator=policy.new_accumulator(),
                       holed=holed)
    st.report.update(policy=cfg.policy, budget=cfg.budget, evicted_tokens=0, live_tokens=None,
                     pages_freed=0, evictions=0)
    return st
