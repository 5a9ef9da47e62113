"""Eviction during prefill (`prefill_chunk`): a long prompt is prefilled in chunks and evicted to
the budget between them (AROUND `Scheduler.stash_chunked_request`), so a request holds at most
``budget + prefill_chunk`` tokens of KV (`EvictConfig.prefill_peak`; `admission.py` ends each
chunk there). After an eviction the ids are row coordinates (the kept entries' ids, then the
prompt's remaining ids), the logical prompt kept aside in `Prompt` (`st.prompt`); with `recall`
the prompt's last chunk is a recalling turn's two chunks (`host_recall.begin_turn`). Diagrams:
docs/design/splice.md, "Eviction during prefill", and docs/design/cache.md, "Recall inside
prefill eviction".
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache import host_recall, pool
from ..core.process import process
from ..core.state import state_of
from .context import DueRow, StepContext, context_of
from .eviction import evict_rows

if TYPE_CHECKING:
    from ..core.sglang_types import Req, Scheduler
    from ..core.state import ReqEvictState


@dataclass
class Prompt:
    """The request's prompt as SGLang holds it: `logical`, its logical prompt while
    `req.origin_input_ids` holds row coordinates (None otherwise), and `prefill_evicted`, the
    prompt tokens evicted during its prefill."""

    logical: array | None = None
    prefill_evicted: int = 0
    whole: bool = False  # pressure trigger: the prompt fits the pool, so it is prefilled whole
    split_: bool = False  # pressure trigger: refused whole on an idle pool: evicted in prefill

    def logical_ids(self, req: Req) -> array:
        """The request's logical token ids (prompt + output), whatever its row holds."""
        prompt = req.origin_input_ids if self.logical is None else self.logical
        return array("q", prompt) + array("q", req.output_ids)

    def adopt(self, req: Req, prompt: array) -> None:
        """`req` continues from a stored view: its prompt becomes the row coordinates `prompt`, its
        logical prompt is kept for `restore`. Its fill ids are the caller's to set."""
        self.logical = req.origin_input_ids
        req.origin_input_ids = prompt

    def row_ids(self, req: Req, ids: array) -> None:
        """`req`'s ids become the row coordinates `ids` (fill ids refreshed); its logical prompt
        is kept for `restore` the first time."""
        if self.logical is None:
            self.logical = req.origin_input_ids
        req.origin_input_ids = ids
        req.refresh_fill_ids()

    def restore(self, req: Req) -> bool:
        """`req` gets its logical prompt back (fill ids refreshed). Returns whether it held row
        coordinates (`ReqEvictState.restore_prompt`)."""
        if self.logical is None:
            return False
        req.origin_input_ids, self.logical = self.logical, None
        req.refresh_fill_ids()
        return True

    def reset(self) -> None:
        """Retraction: its prefill starts over, nothing of it evicted."""
        self.prefill_evicted = 0
        self.whole = self.split_ = False

    def split(self) -> None:
        """Pressure trigger: its prompt was refused whole on an idle pool (SGLang's admission
        reserves more than `decide_whole` counts), so it is evicted during prefill instead."""
        self.whole, self.split_ = False, True

    def decide_whole(self, st: ReqEvictState, req: Req, pool_tokens: int) -> None:
        """Pressure trigger, at the prompt's admission: it is prefilled whole, without eviction,
        when its row fits the `pool_tokens`-token pool: the cached prefix in whole pages (and
        the copy of its partial last page), the rest of the prompt in whole pages, its growth to
        the decode peak and a page; only a prompt that never could is evicted chunk by chunk. A
        whole prompt that does not fit now waits, and the running rows are compacted for it
        (`pressure.due_rows`)."""
        if not st.cfg.on_pressure or st.cfg.prefill_peak is None or req.output_ids or self.split_:
            return
        ps, prefix = st.cfg.page_size, req.prefix_len
        extend = len(req.full_untruncated_fill_ids) - prefix
        row = -(-prefix // ps) * ps + (ps if prefix % ps else 0) + -(-extend // ps) * ps
        self.whole = row + max(0, st.cfg.decode_peak - extend) + ps <= pool_tokens


def evicts_in_prefill(st: ReqEvictState, req: Req) -> bool:
    """Whether `req`'s prefill is evicted in chunks (`prefill_chunk`): a prompt's, not the
    re-prefill of a retracted request's outputs, nor the rest of a last chunk that recalled (it
    is prefilled whole, its scoring window at the prompt's end)."""
    return (
        st.cfg.prefill_peak is not None
        and not req.output_ids
        and st.recall.pinned is None
        and not st.prompt.whole
    )


def chunk_limit(req: Req) -> int | None:
    """The most prompt tokens `req`'s next prefill chunk may take (its row stops at the prefill
    peak, or where a recalling turn's first chunk ends), or None when nothing cuts its prefill."""
    st = state_of(req)
    if st is None:
        return None
    if st.cfg.host.recall and not req.output_ids:
        host_recall.begin_turn(req, st)  # its candidates, and where its prefill is cut
    plan = st.recall.plan
    if plan is not None and req.prefix_len < plan.end:
        return plan.end - req.prefix_len
    if not evicts_in_prefill(st, req):
        return None
    assert st.cfg.prefill_peak is not None, "a prefill evicted in chunks has a peak"
    limit = st.cfg.prefill_peak - req.prefix_len
    if limit <= 0 and st.cfg.on_pressure:
        # A pressure request's cached prefix may pass the peak (whole histories are matched
        # whole): a first chunk of a page, then the row is evicted to the budget.
        return st.cfg.page_size
    if limit <= 0:  # the row reached the peak with prompt left, unevicted: a splice bug
        raise RuntimeError(
            f"request {req.rid}: its row holds {req.prefix_len} tokens, the prefill "
            f"peak is {st.cfg.prefill_peak}"
        )
    return limit


def around_stash_chunked_request(
    original: Callable[[Scheduler, Req], None], scheduler: Scheduler, req: Req
) -> None:
    """AROUND `Scheduler.stash_chunked_request`: after SGLang published a prefill chunk, recall
    into the row if the chunk ends a recalling turn's first chunk (`host_recall.recall_prompt`),
    or evict the row to the budget if it reached the prefill peak."""
    original(scheduler, req)
    st = state_of(req)
    if st is None:
        return
    plan = st.recall.plan
    if plan is not None and req.prefix_len == req.kv.kv_committed_len == plan.end:
        tree = scheduler.tree_cache
        host_recall.recall_prompt(scheduler, req, st, lambda n: pool.alloc(tree, n, req, "recall"))
        return
    if not evicts_in_prefill(st, req):
        return
    assert st.cfg.prefill_peak is not None, "a prefill evicted in chunks has a peak"
    row_len = req.kv.kv_committed_len
    if row_len < st.cfg.prefill_peak or req.prefix_len != row_len:
        return
    ctx = context_of(scheduler)
    st.stats.fold(ctx.tp_group)
    st.retract.start_step(st.stats.snapshot())
    done = row_len + st.row.offset  # logical tokens with KV
    st.prefix.cap_attach(done)  # KV past the first chunk saw a compacted row
    (evicted,) = evict_rows(ctx, [DueRow(req, st, row_len)])
    if evicted is None:
        _end_short(scheduler, ctx, req)
        return
    # The ids become row coordinates: the kept entries' ids, then the prompt's remaining ids.
    logical = st.prompt.logical_ids(req)
    st.prompt.row_ids(
        req, array("q", (logical[p] for p in st.row.kept_pos.tolist())) + logical[done:]
    )
    st.prompt.prefill_evicted += evicted
    st.report.evicted_in_prefill(st.prompt.prefill_evicted)
    # The next chunk continues after the kept entries; none of them counts as a cache hit.
    req.prefix_len = req.already_computed = row_len - evicted


def _end_short(scheduler: Scheduler, ctx: StepContext, req: Req) -> None:
    """No free page for the copies of the cached prompt tokens the row keeps: its prefill cannot
    go on past the peak. The request ends with HTTP 503 through SGLang's own abort of a chunked
    request (its KV released, its client answered); the server serves everyone else."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    ctx.counters.shortage_aborts += 1
    process().shortages.note("prefill_aborted", req.rid)
    req.discard_output_reason = FINISH_ABORT(
        "kv_evict prefill_chunk: no free KV page for the copies of the cached prompt tokens this "
        f"request keeps (the {ctx.total_tokens}-token pool is full); retry later",
        HTTPStatus.SERVICE_UNAVAILABLE,
    )
    scheduler._pending_chunked_abort_req = req
    scheduler.process_pending_chunked_abort()


def unsupported_reason(scheduler: Scheduler) -> str:
    """Why this scheduler cannot evict during prefill ("" when it can), with the settings SGLang
    resolved (`prefill_chunk_problem`)."""
    return prefill_chunk_problem(scheduler.chunked_prefill_size or 0, not scheduler.enable_overlap)


def prefill_chunk_problem(chunked_prefill_size: int | None, overlap_disabled: bool) -> str:
    """Why eviction during prefill cannot run with these SGLang settings ("" when it can): its
    chunks are SGLang's chunked prefill, and the eviction between two chunks needs the first
    chunk's forward to have run (no overlap scheduler)."""
    if chunked_prefill_size is not None and chunked_prefill_size <= 0:
        return "prefill_chunk needs SGLang's chunked prefill (--chunked-prefill-size > 0)"
    if not overlap_disabled:
        return (
            "prefill_chunk needs --disable-overlap-schedule (a chunk's forward must have run "
            "before its eviction)"
        )
    return ""
