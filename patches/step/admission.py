"""Budget-aware admission (splice rule 5, docs/design.md): an evicting request never holds more than
`budget + interval + page_size` tokens of KV, so it reserves at most that, not
`prompt + max_new_tokens`, and `max_new_tokens` is no longer clipped by pool memory.

    reserved for a running request      min(stock estimate, cap - own)
    reserved for a new request          extend + min(max_new, cap - own)
    cap = budget + interval + page_size
    chunk ends at budget + prefill_chunk (eviction during prefill, `prefill.py`): SGLang reserves
          for the chunk it runs, so a prefill never reserves more than that peak
    own = the row's tokens not owned by the radix tree (under the holed cache the tree-owned
          ones, a cached prompt or a stored history's view, leave the row as it evicts, and the
          request's own tokens replace them up to the cap); the whole row otherwise
"""

from __future__ import annotations

from contextlib import contextmanager

from ..state import state_of
from .prefill import chunk_limit


@contextmanager
def _clipped(reqs):
    """Temporarily clip the remaining `max_new_tokens` of evicting requests to what their KV can grow."""
    saved = []
    for req in reqs:
        st = state_of(req)
        if st is None or req.sampling_params.max_new_tokens is None:
            continue
        done = len(req.output_ids)
        row = req.kv.kv_committed_len if req.kv.holds_kv else len(req.origin_input_ids) + done
        # Under the holed radix cache tree-owned tokens (a cached prompt, a stored history's view)
        # leave the row as it evicts and its own tokens replace them, up to the cap.
        tree = (req.kv.cache_protected_len if req.kv.holds_kv else req.prefix_len) if st.holed else 0
        room = max(0, st.cfg.decode_peak - (row - tree))
        clipped = done + min(req.sampling_params.max_new_tokens - done, room)
        if clipped < req.sampling_params.max_new_tokens:
            saved.append((req, req.sampling_params.max_new_tokens))
            req.sampling_params.max_new_tokens = clipped
    try:
        yield
    finally:
        for req, value in saved:
            req.sampling_params.max_new_tokens = value


_ADDER_CLASSES: dict[type, type] = {}


def adder_class(base: type) -> type:
    """A subclass of SGLang's `PrefillAdder` (whatever class the scheduler uses) with budget-aware
    reservations."""
    if base in _ADDER_CLASSES:
        return _ADDER_CLASSES[base]

    class VTokenPrefillAdder(base):
        def _get_running_request_total_token_offset(self, req):
            stock = super()._get_running_request_total_token_offset(req)
            st = state_of(req)
            if st is None:
                return stock
            # Under the holed radix cache tree-owned tokens leave the row; its own part grows to the cap.
            own = req.kv.kv_committed_len - (req.kv.cache_protected_len if st.holed else 0)
            return min(stock, max(0, st.cfg.decode_peak - own))

        def _peers(self, req):
            running = self.running_batch.reqs if self.running_batch is not None else []
            return [req, *running, *self.can_run_list]

        def add_one_req(self, req, has_chunked_req, *args, **kwargs):
            from sglang.srt.managers.schedule_policy import AddReqResult

            st = state_of(req)
            if st is not None and st.retract.blocked:  # its stashed row does not fit the pool yet
                return AddReqResult.NO_TOKEN
            limit = chunk_limit(req)  # eviction during prefill: its first chunk ends at the peak
            forcing = limit is not None and len(req.full_untruncated_fill_ids) - req.prefix_len > limit
            if forcing and (has_chunked_req or self.new_chunked_req is not None):
                return AddReqResult.OTHER  # SGLang carries one chunked request at a time
            saved, exact = self.rem_chunk_tokens, getattr(self, "exact_chunk_fill", False)
            if forcing:
                self.rem_chunk_tokens = min(saved, limit)
                # The chunk ends exactly there: without exact fill SGLang cuts a first chunk at a
                # whole number of pages past the prefix, which after a stored view's partial
                # page misses the boundary (or does not cut at all).
                self.exact_chunk_fill = True
            try:
                with _clipped(self._peers(req)):
                    result = super().add_one_req(req, has_chunked_req, *args, **kwargs)
            finally:
                if forcing:  # what the request took comes off the real chunk budget
                    self.rem_chunk_tokens = saved - (min(saved, limit) - self.rem_chunk_tokens)
                    self.exact_chunk_fill = exact
            if st is not None and st.retract.real_outputs is not None and req not in self.can_run_list:
                st.retract.restore_outputs(req)  # not admitted this round: its real outputs back
            return result

        def add_chunked_req(self, req, *args, **kwargs):
            limit, saved = chunk_limit(req), self.chunked_req_limit
            if limit is not None:  # eviction during prefill: the chunk ends at the peak
                self.chunked_req_limit = limit if saved is None else min(saved, limit)
            try:
                with _clipped([req]):
                    return super().add_chunked_req(req, *args, **kwargs)
            finally:
                self.chunked_req_limit = saved

    VTokenPrefillAdder.__qualname__ = f"VToken{base.__qualname__}"
    _ADDER_CLASSES[base] = VTokenPrefillAdder
    return VTokenPrefillAdder


def around_get_prefill_adder_class(original, scheduler):
    """AROUND `Scheduler.get_prefill_adder_class`."""
    return adder_class(original(scheduler))


def around_init_req_max_new_tokens(original, scheduler, req):
    """AROUND `Scheduler.init_req_max_new_tokens`: keep the context-length clip, drop the memory
    clip for evicting requests (their KV stays bounded by the budget)."""
    requested = req.sampling_params.max_new_tokens
    original(scheduler, req)
    st = state_of(req)
    if st is None or req.finished():
        return
    peak = st.cfg.decode_peak
    if peak > scheduler.max_total_num_tokens:
        req.set_finish_with_abort(
            f"kv_evict.budget {st.cfg.budget}: an evicting request holds up to budget + interval + "
            f"page_size = {peak} KV tokens, more than the pool's {scheduler.max_total_num_tokens}")
        return
    input_len = len(req.origin_input_ids)
    value = (1 << 30) if requested is None else requested
    limit = scheduler.max_new_tokens_limit
    if limit is not None and limit > 0:
        value = min(value, limit)
    value = max(0, min(value, scheduler.model_config.context_len - input_len - 1))
    req.sampling_params.max_new_tokens = value


def around_compute_max_prefix_len(original, req, input_len: int) -> int:
    """AROUND `Req._compute_max_prefix_len`: an evicting request reuses at most
    `budget - window` tokens of a shared prefix (tree-owned tokens are pinned and count against
    its budget; the sinks lie inside the prefix, the window after it)."""
    limit = original(req, input_len)
    st = state_of(req)
    if st is None or st.holed:  # holed radix cache: tree-owned tokens may leave the row
        return limit
    return min(limit, st.cfg.budget - st.cfg.window)
