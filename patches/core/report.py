"""A request's eviction figures (`st.report`): a typed record each concern updates through one
method, serialised in one place (`as_dict`, when `surface/usage.py` hands the output to SGLang)
as `meta_info["kv_evict"][0]`, and summed into `usage.kv_evict`. Optional figures (None) are
left out of the dict; docs/reference.md lists every key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

# Figures every report carries (the others only once they apply).
ALWAYS = ("evicted_tokens", "live_tokens", "pages_freed", "evictions")


@dataclass
class Report:
    """A request's figures; optional ones are None until they apply.

    Attributes:
        evicted_tokens, live_tokens, pages_freed, evictions: its evictions so far.
        deferred_evictions, deferred_admissions: steps put off for want of a page.
        prefill_evicted_tokens: tokens evicted during its prefill.
        history_tokens, history_view_tokens: the stored history it continued (logical tokens,
            live KV).
        history_source, history_restored_tokens: where its history came from ("device": the
            radix cache, "host": restored from host memory, its live tokens copied back;
            "none": prefilled whole).
        offloaded_tokens, host_bytes: its victims in the host store.
        recall_candidates, recall_skipped_tokens, pinned_tokens, recalled_tokens,
            recalled_positions, recall_rounds, recall_ms, recomputed_tokens: its turn's recall
            (rounds summed).
        retracted_reprefill: retracted, then prefilled again with full attention.
        evicted_at, evicted_to: under the pressure trigger, the logical length of the row
            (tokens with KV) at each of its decode evictions, when the pool was short, and the
            tokens it kept.
    """

    evicted_tokens: int = 0
    live_tokens: int | None = None
    pages_freed: int = 0
    evictions: int = 0
    deferred_evictions: int | None = None
    deferred_admissions: int | None = None
    prefill_evicted_tokens: int | None = None
    history_tokens: int | None = None
    history_view_tokens: int | None = None
    history_source: str | None = None
    history_restored_tokens: int | None = None
    offloaded_tokens: int | None = None
    host_bytes: int | None = None
    recall_candidates: int | None = None
    recall_skipped_tokens: int | None = None
    pinned_tokens: int | None = None
    recalled_tokens: int | None = None
    recalled_positions: list[int] | None = None
    recall_rounds: int | None = None
    recall_ms: float | None = None
    recomputed_tokens: int | None = None
    retracted_reprefill: bool | None = None
    evicted_at: list[int] | None = None
    evicted_to: list[int] | None = None

    def as_dict(self, policy: str, budget: int | None) -> dict:
        """The JSON object users read: the request's `policy` and `budget`, the figures of
        `ALWAYS`, and every other that applies."""
        figures = {k: v for k, v in asdict(self).items() if v is not None or k in ALWAYS}
        return {"policy": policy, "budget": budget, **figures}

    def record_eviction(self, evicted: int, live: int, pages_freed: int, evictions: int) -> None:
        """An eviction dropped `evicted` tokens, `live` remain; `pages_freed` and `evictions` are
        the totals so far."""
        self.evicted_tokens += evicted
        self.live_tokens, self.pages_freed, self.evictions = live, pages_freed, evictions

    def record_pressure(self, length: int, kept: int) -> None:
        """A decode eviction ran because the pool was short, at a row of logical `length`,
        keeping `kept` tokens."""
        self.evicted_at = [*(self.evicted_at or []), length]
        self.evicted_to = [*(self.evicted_to or []), kept]

    def defer_eviction(self) -> None:
        """A decode eviction was put off a step (no free page for its copies)."""
        self.deferred_evictions = (self.deferred_evictions or 0) + 1

    def defer_admission(self) -> None:
        """Its admission was put off a round (no free page)."""
        self.deferred_admissions = (self.deferred_admissions or 0) + 1

    def evicted_in_prefill(self, total: int | None) -> None:
        """Tokens evicted during its prefill so far (None: forgotten, the prefill starts over)."""
        self.prefill_evicted_tokens = total

    def continue_history(self, tokens: int, view_tokens: int) -> None:
        """It continues a stored history of `tokens` logical tokens, `view_tokens` of them live."""
        self.history_tokens, self.history_view_tokens = tokens, view_tokens

    def history_from(self, source: str, restored: int = 0) -> None:
        """Its history came from `source` ("device", "host" with `restored` tokens copied back,
        or "none")."""
        self.history_source = source
        self.history_restored_tokens = restored if source == "host" else None

    def offload(self, tokens: int) -> None:
        """`tokens` of its victims went to the host store."""
        self.offloaded_tokens = (self.offloaded_tokens or 0) + tokens

    def hold_host(self, nbytes: int) -> None:
        """Its host chunks now take `nbytes`."""
        self.host_bytes = nbytes

    def recall_from(self, candidates: int) -> None:
        """Its turn recalls from `candidates` host-stored tokens."""
        self.recall_candidates = candidates

    def skip_recall(self, tokens: int) -> None:
        """Its turn went on without recalling (`tokens` it would have recalled)."""
        self.recall_skipped_tokens = tokens

    def recall_round(
        self, pinned: int, positions: list[int], ms: float, recomputed: int, first: bool
    ) -> None:
        """A recall round joined the row: `pinned` tokens recalled in the turn so far, at
        logical `positions`; `ms` and `recomputed` tokens this round (`first`: the turn's first
        round, else added to the earlier rounds')."""
        self.pinned_tokens = self.recalled_tokens = pinned
        self.recalled_positions = positions
        self.recall_rounds = 1 if first else (self.recall_rounds or 0) + 1
        self.recall_ms = round(ms if first else (self.recall_ms or 0) + ms, 3)
        self.recomputed_tokens = recomputed if first else (self.recomputed_tokens or 0) + recomputed

    def reprefill(self) -> None:
        """Retracted without a row to resume from: prefilled again with full attention."""
        self.retracted_reprefill = True

    def snapshot(self) -> Report:
        """A copy, for `restore` (a retraction undoing this step)."""
        return replace(self)

    def restore(self, saved: Report) -> None:
        """Back to the figures `saved` (`snapshot`) had; figures it did not have yet stay."""
        for f in fields(self):
            value = getattr(saved, f.name)
            if value is not None or f.name in ALWAYS:
                setattr(self, f.name, value)
