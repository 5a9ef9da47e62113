"""Retraction keeps what was evicted (page size 1): a retracted evicting request resumes from its
compacted row, so its output stays the masked-reference output.

SGLang retracts a decoding request under memory pressure by freeing its row and re-prefilling
its ids later with full attention: the tokens it had evicted would come back. Instead:

    retract   the row's live K/V (every layer) and positions are copied to host memory (the
              stash); SGLang frees the row as usual, so the device memory is really released
    resume    when the request is matched again, the stash is written back into fresh slots and
              inserted into the radix cache as a holed view under a namespace of its own, and the
              request continues from it like a turn continuing from a stored history
              (`radix.py`): only the last output token, which had no KV yet, is prefilled
    blocked   if the pool cannot hold the view yet, the request is not admitted this round

The policy state (eviction count, attention statistics, report) is kept across the retraction;
the stash is dropped once the request decodes again. A request retracted before its first
eviction is re-prefilled as usual: its KV is full attention, so recomputing it is exact. At page
size > 1 stored views are not available yet and a retracted request is re-prefilled with full
attention (its output then differs from the masked reference; `meta_info["kv_evict"]` says
`"retracted_reprefill": true`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from .state import state_of


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


def before_release_req(*args, req, tree_cache, **kwargs):
    """BEFORE `schedule_batch.release_req` (retraction only): stash an evicting request's row."""
    st = state_of(req)
    if st is None or req.finished() or not req.kv.holds_kv or not (st.steps or st.hit is not None):
        return None
    # No stored views at page size > 1 (or without the holed cache): re-prefilled, stash None.
    stash = stash_row(req, st, tree_cache) if st.holed and st.cfg.page_size == 1 else None
    st.retracted(stash)
    return None


def stash_row(req, st, tree_cache) -> RetractStash:
    """Copy the request's row as it was before this step (K/V of every layer, positions) to host
    memory, and put its policy state back to that moment.

    The retraction drops the in-flight step: its result is discarded and the last output token
    is prefilled again when the request resumes, over the same row as when it was first computed
    (the row before this step's eviction; the evicted slots are freed but not yet reused). So the
    stash is that row without its last token, and the eviction and statistics of this step are
    redone after the resume, identically."""
    ids = st.logical_ids(req)
    depth = len(ids) - 1
    before = st.undo_step()
    if before is not None:  # this step evicted: the row before it
        slots, positions = before
    else:
        row_len = req.kv.kv_committed_len
        req_to_token = tree_cache.req_to_token_pool.req_to_token
        slots, positions = req_to_token[req.kv.req_pool_idx, :row_len].to(torch.int64), st.positions(row_len)
    live = int((positions < depth).sum())  # positions ascend: the kept entries are a row prefix
    index = slots[:live].to(tree_cache.token_to_kv_pool_allocator.device)
    pool = tree_cache.token_to_kv_pool_allocator.get_kvcache()
    keys = torch.stack([pool.get_key_buffer(layer)[index] for layer in range(pool.layer_num)]).cpu()
    values = torch.stack([pool.get_value_buffer(layer)[index] for layer in range(pool.layer_num)]).cpu()
    serial = st.retractions + 1  # `ReqEvictState.retracted` counts this retraction
    namespace = f"{req.extra_key or ''}|{st.cfg.history_namespace()}|retract:{req.rid}:{serial}"
    return RetractStash(ids=ids[:depth], positions=positions[:live].cpu(), keys=keys, values=values,
                        namespace=namespace)


def write_back(tree_cache, stash: RetractStash) -> torch.Tensor | None:
    """Fresh slots holding the stash's K/V, or None when the pool cannot hold them now."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    allocator = tree_cache.token_to_kv_pool_allocator
    n = stash.positions.numel()
    if allocator.available_size() < n:
        tree_cache.evict(EvictParams(num_tokens=n))
    if allocator.available_size() < n:
        return None
    slots = allocator.alloc(n)
    pool = allocator.get_kvcache()
    index = slots.to(torch.int64)
    for layer in range(pool.layer_num):
        k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        k[index] = stash.keys[layer].to(k.device, k.dtype)
        v[index] = stash.values[layer].to(v.device, v.dtype)
    return index


def adopt_retracted(req, st, logical: array, positions: torch.Tensor, depth: int) -> None:
    """Resume a retracted request from its view. SGLang prefills `origin + output` past the
    prefix, but the view may hold fewer entries than the request has outputs (outputs evicted
    too). Until its prefill is prepared the request is therefore split at the view instead:
    origin = the view's prompt entries, output = the view's output entries + the ids past
    `depth` (the last output); `ReqEvictState.prefill_set_up` puts the real outputs back."""
    prompt_len = len(logical) - len(req.output_ids)
    pos = positions.tolist()
    st.adopt_view(req, positions, depth, array("q", (logical[p] for p in pos if p < prompt_len)),
                  outputs=array("q", (logical[p] for p in pos if p >= prompt_len)) + logical[depth:])


def after_prepare_for_extend(result, batch):
    """AFTER `ScheduleBatch.prepare_for_extend`: resumed requests get their real outputs back."""
    for req in batch.reqs:
        st = state_of(req)
        if st is not None:
            st.prefill_set_up(req)
