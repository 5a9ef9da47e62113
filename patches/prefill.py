"""Eviction during prefill (`prefill_chunk`, docs/design.md): a long prompt is prefilled in chunks
and evicted to the budget between them, so a request never holds more than
``budget + prefill_chunk`` tokens of KV (`EvictConfig.prefill_peak`).

SGLang's chunked prefill carries the request from chunk to chunk (`Scheduler.chunked_req`);
`admission.py` ends each chunk where the row reaches the peak, and this hook evicts there,
after SGLang published the chunk (`stash_chunked_request`) and before the next chunk is
scheduled. The row is then the kept entries, the ids become row coordinates (the kept entries'
ids, then the prompt's remaining ids) and the next chunk continues after them at its logical
positions (the position offset, splice rule 1)::

    logical  | 0 ........................ e | e ...... prompt end |
    row      | kept (budget) | ........... | -> next chunk at row index budget, position e
             0            budget      budget + prefill_chunk = e - offset before the eviction

The chunk's attention statistics (its last `obs_window` queries, `scores.prepare`) are folded
first, so attention policies score with them.
"""

from __future__ import annotations

from array import array

from . import host_tier
from .eviction import alloc_slots, evict_rows
from .server_args import prefill_chunk_problem
from .state import state_of


def chunk_limit(req) -> int | None:
    """The most prompt tokens `req`'s next prefill chunk may take (its row stops at the prefill
    peak, or where a recalling turn's first chunk ends), or None when nothing cuts its prefill."""
    st = state_of(req)
    if st is None:
        return None
    if st.cfg.recall and not req.output_ids:
        host_tier.begin_turn(req, st)  # its candidates, and where its prefill is cut
    if st.recall is not None and req.prefix_len < st.recall.end:
        return st.recall.end - req.prefix_len
    if not st.evicts_in_prefill(req):
        return None
    limit = st.cfg.prefill_peak - req.prefix_len
    if limit <= 0:  # the row reached the peak with prompt left, unevicted: a splice bug
        raise RuntimeError(f"request {req.rid}: its row holds {req.prefix_len} tokens, the prefill "
                           f"peak is {st.cfg.prefill_peak}")
    return limit


def around_stash_chunked_request(original, scheduler, req):
    """AROUND `Scheduler.stash_chunked_request`: after SGLang published a prefill chunk, recall
    into the row if the chunk ends a recalling turn's first chunk (`host_tier.recall_prompt`),
    or evict the row to the budget if it reached the prefill peak."""
    original(scheduler, req)
    st = state_of(req)
    if st is None:
        return
    if st.recall is not None and req.prefix_len == req.kv.kv_committed_len == st.recall.end:
        host_tier.recall_prompt(scheduler, req, st, lambda n: alloc_slots(scheduler, n))
        return
    if not st.evicts_in_prefill(req):
        return
    row_len = req.kv.kv_committed_len
    if row_len < st.cfg.prefill_peak or req.prefix_len != row_len:
        return
    if st.accumulator is not None:
        st.fold_staged(getattr(scheduler, "tp_group", None))
    st.start_step()
    done = row_len + st.offset  # logical tokens with KV
    st.attach = min(st.attach, done)  # KV past the first chunk saw a compacted row
    (evicted,) = evict_rows(scheduler, [(req, st, row_len)])
    if not evicted:
        raise RuntimeError(f"prefill eviction of request {req.rid}: no free page for the copies "
                           f"of its tree-owned tokens ({row_len} row tokens)")
    logical = st.logical_ids(req)
    st.compact_prompt(req, array("q", (logical[p] for p in st.kept_pos.tolist())) + logical[done:], evicted)
    # The next chunk continues after the kept entries; none of them counts as a cache hit.
    req.prefix_len = req.already_computed = row_len - evicted


def unsupported_reason(scheduler) -> str:
    """Why this scheduler cannot evict during prefill ("" when it can), with the settings SGLang
    resolved (`server_args.prefill_chunk_problem`)."""
    return prefill_chunk_problem(scheduler.chunked_prefill_size or 0, not scheduler.enable_overlap)
