"""Budget-aware admission (splice rule 5): a `PrefillAdder` subclass (AROUND
`Scheduler.get_prefill_adder_class`), `max_new_tokens` clipped by the context length only
(`init_req_max_new_tokens`) and a shared prefix capped on a stock radix cache
(`Req._compute_max_prefix_len`).

An evicting request reserves at most its decode peak, `budget + interval + page_size` of its own
tokens, not `prompt + max_new_tokens`, and a chunk evicted during prefill ends at the prefill
peak. A request refused on an idle pool would be refused at every pass and hold up the queue: it
asks at most what an idle pool offers when evicted during prefill, else ends with HTTP 400.
Reservations and reasons: docs/design/step.md, "Admission".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from sgl_vtoken.config import EvictConfig

from ..cache import history_pages
from ..core.model_support import peak_problem
from ..core.process import process
from ..core.state import state_of
from .prefill import chunk_limit, evicts_in_prefill

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_policy import AddReqResult

    from ..core.sglang_types import Req, Scheduler
    from ..core.state import ReqEvictState


@contextmanager
def _clipped(reqs: Iterable[Req]) -> Iterator[None]:
    """Temporarily clip the remaining `max_new_tokens` of evicting requests to what their KV can
    grow."""
    saved = []
    for req in reqs:
        st = state_of(req)
        if st is None or req.sampling_params.max_new_tokens is None:
            continue
        done = len(req.output_ids)
        row = req.kv.kv_committed_len if req.kv.holds_kv else len(req.origin_input_ids) + done
        # Under the holed radix cache tree-owned tokens (a cached prompt, a stored history's view)
        # leave the row as it evicts and its own tokens replace them, up to the cap.
        tree = (
            (req.kv.cache_protected_len if req.kv.holds_kv else req.prefix_len) if st.holed else 0
        )
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


def _refuse(
    req: Req, st: ReqEvictState | None, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST
) -> None:
    """Finish a request SGLang can never admit (HTTP 400) or the plugin can never give its pages
    (HTTP 503) instead of letting it hold up the queue; an evicting request gets its logical ids
    back first, so that the abort's one-token prompt stays. Requests without eviction too: SGLang
    0.5.23 would refuse them at every pass (docs/upstream-admission-livelock.md)."""
    if st is not None:
        retracted = st.retract.stash is not None
        st.restore_prompt(req)
        st.retract.drop()
        if retracted:  # its statistics still described the stashed row: it starts over as a prompt
            st.reset()
    req.set_finish_with_abort(
        message,
        status,
        "BadRequestError" if status == HTTPStatus.BAD_REQUEST else "ServiceUnavailableError",
    )


def _never_fits(req: Req, pool_tokens: int) -> str:
    extend = len(req.full_untruncated_fill_ids) - req.prefix_len
    return (
        f"this request can never be scheduled: its prefill of {extend} tokens (past a cached "
        f"prefix of {req.prefix_len}), plus a page, needs more than the {pool_tokens}-token KV "
        "pool holds with nothing else in it; send a shorter prompt, or evict during prefill "
        "(kv_evict prefill_chunk)"
    )


def _no_page(what: str, pool_tokens: int) -> str:
    return (
        f"kv_evict: no free KV page for {what}, with nothing else in the {pool_tokens}-token "
        "pool; retry later"
    )


_ADDER_CLASSES: dict[type, type] = {}


def adder_class(base: type) -> type:
    """A subclass of SGLang's `PrefillAdder` (whatever class the scheduler uses) with budget-aware
    reservations."""
    if base in _ADDER_CLASSES:
        return _ADDER_CLASSES[base]

    class VTokenPrefillAdder(base):
        # `PrefillAdder` fields this class writes (set by SGLang's __init__; annotations only).
        new_chunked_req: Req | None
        rem_chunk_tokens: int | None
        chunked_req_limit: int | None
        exact_chunk_fill: bool

        _vt_cut: Req | None = None  # the request `add_one_req` admits for a prefill-eviction chunk

        def _get_running_request_total_token_offset(self, req: Req) -> int:
            stock = super()._get_running_request_total_token_offset(req)
            st = state_of(req)
            if st is None:
                return stock
            # Under the holed radix cache tree-owned tokens leave the row; its own part grows to
            # the cap.
            own = req.kv.kv_committed_len - (req.kv.cache_protected_len if st.holed else 0)
            return min(stock, max(0, st.cfg.decode_peak - own))

        def _peers(self, req: Req) -> list[Req]:
            running = self.running_batch.reqs if self.running_batch is not None else []
            return [req, *running, *self.can_run_list]

        def _check_prefill_budget(
            self, req: Req, *, total_tokens: int, **kwargs: Any
        ) -> tuple[bool, int | None]:
            if self._vt_cut is req:
                # Eviction during prefill: SGLang asks room for the whole rest of the prompt, more
                # than the pool offers even idle when the prompt is near its size. Ask at most what
                # an idle pool offers (every slot not locked, its own prefix's lock included): such
                # a request waits until nothing else holds memory, then runs chunk by chunk.
                idle = self.token_to_kv_pool_allocator.size - self.tree_cache.protected_size()
                total_tokens = min(total_tokens, idle - 1)
            return super()._check_prefill_budget(req, total_tokens=total_tokens, **kwargs)

        def _idle(self, has_chunked_req: bool) -> bool:
            """Nothing runs or was admitted, and every slot of the pool is free or evictable: what
            SGLang refuses now it refuses at every pass (nothing can free memory for it)."""
            if self.can_run_list or has_chunked_req or self.new_chunked_req is not None:
                return False
            if self.running_batch is not None and not self.running_batch.is_empty():
                return False
            pool = self.token_to_kv_pool_allocator
            return pool.available_size() + self.tree_cache.evictable_size() >= pool.size

        def _take_back(self, req: Req) -> None:
            """Undo SGLang's admission of `req` this round: out of the batch, its prefix unlocked
            (what it was charged stays charged: this round admits less)."""
            self.can_run_list.remove(req)
            if self.new_chunked_req is req:
                self.new_chunked_req = None
            self.tree_cache.unlock(req.lock)
            req.lock = None

        def _defer(
            self, req: Req, st: ReqEvictState, what: str, page: str, has_chunked_req: bool
        ) -> None:
            """`req` waits a round: no free page for `what` (`page`: a kind of `shortage.KINDS`;
            counted, `core/shortage.py`); on an idle pool it never gets one, and ends with HTTP
            503."""
            proc = process()
            proc.counters.deferred_admissions += 1
            st.report.defer_admission()
            proc.shortages.note("admission_deferred", req.rid, page)
            if self._idle(has_chunked_req):
                proc.counters.shortage_aborts += 1
                proc.shortages.note("admission_aborted", req.rid, page)
                _refuse(
                    req,
                    st,
                    _no_page(what, self.token_to_kv_pool_allocator.size),
                    HTTPStatus.SERVICE_UNAVAILABLE,
                )

        def add_one_req(
            self, req: Req, has_chunked_req: bool, *args: Any, **kwargs: Any
        ) -> AddReqResult:
            from sglang.srt.managers.schedule_policy import AddReqResult

            st = state_of(req)
            if st is not None and st.retract.blocked:  # its stashed row does not fit the pool yet
                self._defer(req, st, "a retracted row written back", "resume", has_chunked_req)
                return AddReqResult.NO_TOKEN
            if st is not None and st.prefix.restore_blocked:  # its host history does not fit yet
                self._defer(req, st, "a history restored from host", "restore", has_chunked_req)
                return AddReqResult.NO_TOKEN
            if st is not None and not req.kv.holds_kv:  # pressure: whole when it fits the pool
                st.prompt.decide_whole(st, req, self.token_to_kv_pool_allocator.size)
            limit = chunk_limit(req)  # eviction during prefill: its first chunk ends at the peak
            saved, exact = self.rem_chunk_tokens, getattr(self, "exact_chunk_fill", False)
            # Without SGLang's chunked prefill (`saved` None) nothing cuts the prompt: only a
            # per-request recall gets here (the launcher refuses server-wide recall and
            # prefill_chunk then), and its turn goes on unrecalled, counted (`scores.prepare`).
            forcing = (
                limit is not None
                and saved is not None
                and len(req.full_untruncated_fill_ids) - req.prefix_len > limit
            )
            if forcing and (has_chunked_req or self.new_chunked_req is not None):
                return AddReqResult.OTHER  # SGLang carries one chunked request at a time
            cap = None  # the forced chunk's token budget
            if forcing:
                assert limit is not None and saved is not None
                cap = self.rem_chunk_tokens = min(saved, limit)
                # The chunk ends exactly there: without exact fill SGLang cuts a first chunk at a
                # whole number of pages past the prefix, which after a stored view's partial
                # page misses the boundary (or does not cut at all).
                self.exact_chunk_fill = True
            if forcing and st is not None and evicts_in_prefill(st, req):  # forcing: st is set
                self._vt_cut = req
            try:
                with _clipped(self._peers(req)):
                    result = super().add_one_req(req, has_chunked_req, *args, **kwargs)
            finally:
                self._vt_cut = None
                if cap is not None:  # what the request took comes off the real chunk budget
                    left = self.rem_chunk_tokens
                    assert saved is not None and left is not None
                    self.rem_chunk_tokens = saved - (cap - left)
                    self.exact_chunk_fill = exact
            deferred = (
                req in self.can_run_list
                and st is not None
                and not history_pages.own_tail(self.tree_cache, req, st)
            )
            if deferred:
                assert st is not None, "only an evicting request is deferred"
                self._take_back(req)
                self._defer(
                    req, st, "the copy of a stored view's last page", "tail", has_chunked_req
                )
                result = AddReqResult.NO_TOKEN
            elif (
                result == AddReqResult.NO_TOKEN
                and req not in self.can_run_list
                and self._idle(has_chunked_req)
            ):
                if st is not None and st.prompt.whole:
                    # Pressure trigger: refused whole on an idle pool, the prompt is evicted
                    # during prefill from the next pass on instead.
                    st.prompt.split()
                else:
                    _refuse(req, st, _never_fits(req, self.token_to_kv_pool_allocator.size))
            if (
                st is not None
                and st.retract.real_outputs is not None
                and req not in self.can_run_list
            ):
                st.retract.restore_outputs(req)  # not admitted this round: its real outputs back
            return result

        def add_chunked_req(self, req: Req, *args: Any, **kwargs: Any) -> Req | None:
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


def around_get_prefill_adder_class(
    original: Callable[[Scheduler], type], scheduler: Scheduler
) -> type:
    """AROUND `Scheduler.get_prefill_adder_class`."""
    return adder_class(original(scheduler))


def around_init_req_max_new_tokens(
    original: Callable[[Scheduler, Req], None], scheduler: Scheduler, req: Req
) -> None:
    """AROUND `Scheduler.init_req_max_new_tokens`: keep the context-length clip, drop the memory
    clip for evicting requests (their KV stays bounded by the budget)."""
    requested = req.sampling_params.max_new_tokens
    original(scheduler, req)
    st = state_of(req)
    if st is None or req.finished():
        return
    problem = peak_problem(st.cfg, scheduler.max_total_num_tokens, "kv_evict.budget")
    if problem:
        req.set_finish_with_abort(problem)
        return
    input_len = len(req.origin_input_ids)
    value = (1 << 30) if requested is None else requested
    limit = scheduler.max_new_tokens_limit
    if limit is not None and limit > 0:
        value = min(value, limit)
    value = max(0, min(value, scheduler.model_config.context_len - input_len - 1))
    req.sampling_params.max_new_tokens = value


def around_compute_max_prefix_len(
    original: Callable[[Req, int], int], req: Req, input_len: int
) -> int:
    """AROUND `Req._compute_max_prefix_len`: an evicting request reuses at most
    `budget - window` tokens of a shared prefix (tree-owned tokens are pinned and count against
    its budget; the sinks lie inside the prefix, the window after it)."""
    limit = original(req, input_len)
    st = state_of(req)
    if st is None or st.holed:  # holed radix cache: tree-owned tokens may leave the row
        return limit
    return min(limit, st.cfg.row_budget - st.cfg.window)


# SGLang's margin below the context length (`TpModelWorker`: min(context - 1, pool - 1) - 5).
_INPUT_MARGIN = 6


def around_validate_input_length(
    original: Callable[[Req, int, bool], str | None],
    req: Req,
    max_req_input_len: int,
    allow_auto_truncate: bool,
) -> str | None:
    """AROUND `validate_input_length` (as the scheduler calls it): a request evicted during
    prefill holds at most `cfg.prefill_hold` tokens however long its prompt, so its prompt is
    limited by the model's context length, not by the pool (SGLang's `pool - 6`). A request the
    pool's limit refuses on a server that evicts is told what lifts it."""
    st, context = state_of(req), process().context_len
    context_limit = context - _INPUT_MARGIN
    if st is not None and evicts_in_prefill(st, req) and context_limit > max_req_input_len:
        error = original(req, context_limit, allow_auto_truncate)
        if error:
            error += f" The model's context length, {context}, limits it."
        return error
    error = original(req, max_req_input_len, allow_auto_truncate)
    if error and context_limit > max_req_input_len and EvictConfig.from_env().enabled:
        error += (
            " The KV pool limits it: a request evicted during prefill (kv_evict policy, "
            f"--kv-evict-config prefill_chunk) may reach {context_limit} tokens, the model's "
            f"context length {context} less {_INPUT_MARGIN}."
        )
    return error
