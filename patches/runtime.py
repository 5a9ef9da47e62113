"""Scheduler-process hooks: per-request state, logical positions, eviction before the memory check.

Every hook acts only on requests that carry eviction state (the server's `--kv-evict`, or a
request's own `kv_evict`): other requests behave exactly as in stock SGLang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sgl_vtoken.config import EvictConfig, policy_from_config
from sgl_vtoken.rng import stable_id

from .cache import host_recall, host_tier, prefix, radix
from .cache.host_tier import HostTier
from .core.model_support import kv_bytes_per_token, peak_problem, unsupported_pool_reason
from .core.process import process, start
from .core.report import Report
from .core.row import Row
from .core.state import ReqEvictState, state_of
from .step import held, prefill, retraction, scores
from .step.context import context_of
from .step.decode import evict_batch
from .step.reclaim import reclaim_for
from .surface import metrics
from .surface.request_options import request_config
from .surface.server_args import server_config

if TYPE_CHECKING:
    from .core.sglang_types import (
        ForwardBatch,
        ModelRunner,
        RadixTree,
        Req,
        ScheduleBatch,
        Scheduler,
    )


def new_state(cfg: EvictConfig, rid: str, holed: bool) -> ReqEvictState:
    """Fresh state of a request `rid` evicting under `cfg`; `holed`: served by the holed radix
    cache's paths (`radix.tree_mode(cfg)`)."""
    policy = policy_from_config(cfg)
    return ReqEvictState(
        cfg=cfg,
        policy=policy,
        rid=stable_id(rid),
        holed=holed,
        reclaim=reclaim_for(cfg),
        report=Report(),
        row=Row(),
        stats=scores.Stats(policy.new_accumulator()),
        prefix=prefix.Prefix(),
        naive=held.NaiveHold(),
        retract=retraction.Retraction(),
        prompt=prefill.Prompt(),
        host=host_tier.HostChunks(),
        recall=host_recall.Recall(),
    )


def after_req_init(result: None, req: Req, rid: str, *args: object, **kwargs: object) -> None:
    """AFTER `Req.__init__`: attach eviction state (server settings, or the request's own
    `kv_evict`); an evicting request is never inserted into the radix tree as if its compacted
    row were contiguous (splice rule 3, docs/design/splice.md)."""
    cfg = request_config(server_config(), req.sampling_params)
    if cfg.enabled:
        req.vtoken = new_state(cfg, rid, holed=radix.tree_mode(cfg))
        # The holed radix cache (radix.py) inserts compacted rows correctly; others must not.
        req.skip_radix_cache_insert = not req.vtoken.holed
        if cfg.reclaim == "naive" and cfg.page_size > 1:  # it may hold pages back (held.py)
            held.count_held(req, req.vtoken)


def after_reset_for_retract(result: None, req: Req) -> None:
    """AFTER `Req.reset_for_retract`: back to the logical ids; the request resumes from its stash
    (`retraction.py`) or is re-prefilled from its ids with full attention."""
    st = state_of(req)
    if st is not None:
        st.restore_prompt(req)
        st.reset()


def before_release_kv_cache(
    req: Req, tree_cache: RadixTree, *args: object, **kwargs: object
) -> None:
    """BEFORE `mem_cache.common.release_kv_cache`: return pages held back in naive mode; a
    finished request's recalled tokens leave its row before it is stored (`host_recall.py`)."""
    held.release_held(req, tree_cache.token_to_kv_pool_allocator)
    if req.finished():
        host_recall.drop_recalled(req, tree_cache)


def after_release_kv_cache(
    result: object, req: Req, tree_cache: RadixTree, *args: object, **kwargs: object
) -> object:
    """AFTER `mem_cache.common.release_kv_cache`: a finished request's host chunks that its
    stored view did not take are released (`host_tier.py`)."""
    host_tier.release_finished(req)
    return result


def after_forward_batch_init(
    result: ForwardBatch,
    cls: type,
    batch: ScheduleBatch,
    model_runner: ModelRunner,
    *args: object,
    **kwargs: object,
) -> ForwardBatch:
    """AFTER `ForwardBatch.init_new`: add each request's position offset (splice rule 1,
    docs/design/splice.md).

    Offsets are read when the batch is built, right after this step's eviction, so they match
    the row under the overlap scheduler too.
    """
    reqs = getattr(batch, "reqs", None)
    if not reqs or result.positions is None:
        scores.clear()
        return result
    if process().tier is not None and not result.forward_mode.is_decode():
        for r in reqs:
            if (st := state_of(r)) is not None:
                host_recall.begin_turn(r, st)  # it takes its view's host store; recall candidates
    scored = scores.scored_requests(batch)
    if scored:
        scores.prepare(result, scored, model_runner)
    else:
        scores.clear()
    offsets = [st.row.offset if (st := state_of(r)) is not None else 0 for r in reqs]
    if not any(offsets):
        return result
    off = torch.tensor(offsets, dtype=result.positions.dtype)
    if result.forward_mode.is_decode():
        assert result.positions.numel() == len(reqs), (result.positions.shape, len(reqs))
    else:
        off = torch.repeat_interleave(off, torch.tensor(result.extend_seq_lens_cpu))
    result.positions = result.positions + off.to(result.positions.device, non_blocking=True)
    return result


def after_scheduler_init(
    result: None, scheduler: Scheduler, *args: object, **kwargs: object
) -> None:
    """AFTER `Scheduler.__init__`. With a server policy: refuse a pool eviction cannot compact or
    too small for one evicting request, and size the counters. Without one, nothing of the pool
    is read until a request evicts (any pool type, MLA's included, starts as in stock SGLang)."""
    cfg = server_config()
    holed = isinstance(scheduler.tree_cache, radix.HoledRadixCache)
    if cfg.enabled:
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        reason = unsupported_pool_reason(pool) or peak_problem(
            cfg, scheduler.max_total_num_tokens, "--kv-budget"
        )
        if not reason and cfg.prefill.chunk is not None:
            reason = prefill.unsupported_reason(scheduler)
        if reason:
            raise ValueError(f"--kv-evict {cfg.policy}: {reason}")
    if cfg.host.tokens and not holed:
        raise ValueError(
            "--kv-evict-config host_tokens: the host store keeps stored histories' evicted "
            "tokens, which needs the holed radix cache (a policy with reuse_history)"
        )
    proc = scheduler.vtoken = start(
        holed=holed,
        tier=HostTier(cfg.host.tokens) if cfg.host.tokens else None,
        context_len=scheduler.model_config.context_len,
    )
    if cfg.enabled:
        proc.counters.bytes_per_token = kv_bytes_per_token(pool)
    proc.metrics = metrics.maybe_create(scheduler)


def around_update_running_batch(
    original: Callable[[Scheduler, ScheduleBatch], ScheduleBatch | None],
    scheduler: Scheduler,
    batch: ScheduleBatch,
) -> ScheduleBatch | None:
    """AROUND `Scheduler.update_running_batch`: evict before `check_decode_mem` and
    `prepare_for_decode`, skipping requests whose last token is already in flight."""
    if batch is not None and not batch.is_empty():
        proc = process()
        if any(state_of(r) is not None for r in batch.reqs):
            skip = set(scheduler._reqs_finishing_inflight(batch))
            limit = getattr(scheduler, "max_running_requests", 1 << 30)
            places = limit - batch.batch_size()
            evict_batch(context_of(scheduler), batch, skip, scheduler.waiting_queue, places)
        else:  # no evicting request runs
            proc.counters.no_running()
        if proc.metrics is not None:
            proc.metrics.publish(
                proc.counters, proc.tier.as_dict() if proc.tier is not None else None
            )
    return original(scheduler, batch)
