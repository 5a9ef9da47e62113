"""Decode-time recall (`recall_steps`): each of a turn's first decode steps scores the host
store's candidates with its own query, and the best come back before the step's token is taken.

A prompt's question rarely points at the fact its answer needs; the query that writes the answer
does (docs/RESULTS.md, "Which queries find the key"). AROUND
`TpModelWorker.forward_batch_generation` (no overlap scheduler): a decode batch with a due lane
(one of its turn's first `recall_steps` steps, candidates left) runs; its forward scores the
lane's candidates with the lane's query over the row and the candidates (`scores.py`); the best
comes back with the candidates after it within `recall_span` positions
(`sgl_vtoken.recall.decode_pick`); they join the row before the step's own entry (the row's
last entry stays its newest), pinned for the turn (`host_recall.drop_recalled` takes them out
before it is stored), and the batch's forward runs again with them visible. Only that
forward's tokens are sampled and streamed::

    the step's forward    | kept ... | t |                      seq_len s, its query scores
    it recalls n          | kept ... | r1 .. rn | t |           seq_len s + n, t computed again
    the next step         | kept ... | r1 .. rn | t | t+1 |

Every lane of the batch is recomputed (same inputs, same slots). Design: docs/design.md,
"Decode-time recall".
"""

from __future__ import annotations

import time
from functools import partial

import torch

from sgl_vtoken.recall import decode_pick

from ..cache import host_recall, pool
from ..core.process import process
from ..core.state import state_of

OVERLAP_PROBLEM = (
    "recall_steps needs --disable-overlap-schedule (a decode step that recalls is computed "
    "again before its token is taken)"
)


def due(req, st) -> bool:
    """Whether `req`'s decode step about to run recalls (`st.recall.stepping` is then its plan):
    one of its turn's first `recall_steps` steps, with candidates left (looked up once a turn:
    what its host chunks hold that its row lacks)."""
    steps = st.cfg.host.steps
    on = bool(steps) and 0 < len(req.output_ids) <= steps and req.kv.holds_kv
    if on and not st.recall.decode_looked:
        row = st.row.positions(req.kv.kv_committed_len)
        found = host_recall.candidates(st, int(row[-1]) + 1, row)
        plan = None
        if found is not None:
            plan = host_recall.RecallPlan(*found, torch.zeros(found[0].numel()), 0, 0)
            st.report.recall_from(int(found[0].numel()))
        st.recall.look_up(plan)
    return st.recall.arm(on)


def around_forward_batch_generation(original, worker, batch=None, *args, **kwargs):
    """AROUND `TpModelWorker.forward_batch_generation`: a decode step whose due lanes recalled is
    computed again with the recalled tokens visible; the first forward's tokens are dropped."""
    if batch is None or not batch.forward_mode.is_decode():
        return original(worker, batch, *args, **kwargs)
    lanes = [(i, r, st) for i, r in enumerate(batch.reqs) if (st := state_of(r)) is not None]
    recalling = [(i, r, st) for i, r, st in lanes if due(r, st)]
    if not recalling:
        return original(worker, batch, *args, **kwargs)
    staged = [len(st.stats.staged) for _, _, st in lanes]
    input_ids = batch.input_ids
    result = original(worker, batch, *args, **kwargs)
    joined = [join(batch, i, r, st) for i, r, st in recalling]
    if not any(joined):
        return result
    for (_, _, st), n in zip(lanes, staged):  # the recomputed forward stages them again
        del st.stats.staged[n:]
    batch.input_ids = input_ids
    return original(worker, batch, *args, **kwargs)


def join(batch, i: int, req, st) -> bool:
    """Lane `i`'s step scored its candidates (its forward ran): the best and those after it within
    `recall_span` join its row just before the step's own entry, which moves after them (slots
    page-dense: the first recalled takes the step's slot, the step the slot after the last; its
    K/V is written there by the forward run again); its lengths and the batch's grow by them,
    and they are pinned. Returns whether any joined (False: no free page, counted as a skipped
    recall)."""
    plan = st.recall.take_step()
    if plan.scored is not None:  # CUDA: the last layer's scores are written
        plan.scored.synchronize()
    t0 = time.perf_counter()
    sel = decode_pick(plan.scores, plan.left_positions(), st.cfg.host.span)
    chosen, n = plan.chosen(sel), int(sel.numel())
    kv, tree = req.kv, batch.tree_cache
    s, allocator = kv.kv_committed_len, tree.token_to_kv_pool_allocator
    req_to_token = batch.req_to_token_pool.req_to_token
    row = req_to_token[kv.req_pool_idx, :s].to(torch.int64)
    alloc = partial(pool.alloc, tree, req=req, kind="recall")
    slots = host_recall.page_dense(row, s - 1, n + 1, allocator.page_size, alloc)
    if slots is None:  # no free page: the step goes on without them
        host_recall.skipped(st, req.rid, n, "page")
        return False
    host_recall.write_kv(allocator.get_kvcache(), slots[:n], plan.k[chosen], plan.v[chosen])
    req_to_token[kv.req_pool_idx, s - 1 : s + n] = slots.to(req_to_token.dtype)
    kv.kv_committed_len += n
    kv.kv_allocated_len += n
    _grow(batch, i, n, int(slots[n]))
    recalled = plan.candidates[chosen]
    t = int(st.row.positions(s)[-1])  # the step's own token
    st.row.join(s - 1, recalled, t)
    st.stats.recalled(s - 1, n)
    st.recall.pin(recalled)
    st.recall.decoded(plan, sel)
    seconds = time.perf_counter() - t0
    st.report.recall_step(n, st.recall.pinned.tolist(), seconds * 1e3)
    process().tier.count_recall(n, seconds)
    return True


def _grow(batch, i: int, n: int, slot: int) -> None:
    """Lane `i` of `batch` has `n` more entries and its step's K/V goes to `slot`: new tensors
    (an older view of the batch may still read the old ones)."""
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        lens = getattr(batch, name, None)
        if lens is not None:
            lens = lens.clone()
            lens[i] += n
            setattr(batch, name, lens)
    batch.seq_lens_sum = None
    loc = batch.out_cache_loc.clone()
    loc[i] = slot
    batch.out_cache_loc = loc
