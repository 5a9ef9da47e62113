"""What a user sees of eviction: per request in `meta_info["kv_evict"]`, server-wide in
`/get_server_info` (`internal_states[i]["vtoken"]`).

Per request (a one-element list, SGLang's request-level customized-info format, sent with the
final output, or with the first chunk of a stream): policy, evicted tokens, live tokens after the
last eviction, pages freed. Server-wide: the settings and `VTokenCounters`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.process import process
from ..core.state import state_of
from .server_args import server_config

if TYPE_CHECKING:
    from ..core.sglang_types import Scheduler

META_KEY = "kv_evict"


def naive_held_requests(scheduler: Scheduler) -> int:
    """Requests holding pages back (`held.py`). Only a decoding request holds any (release and
    retraction return them), so it is in the running batch or in the batch that ran last."""
    batches = (getattr(scheduler, "running_batch", None), getattr(scheduler, "last_batch", None))
    reqs = {id(r): r for b in batches if b is not None for r in b.reqs}
    return sum(1 for r in reqs.values() if (st := state_of(r)) is not None and len(st.naive.held))


def after_get_internal_state(
    result: object, scheduler: Scheduler, *args: object, **kwargs: object
) -> object:
    """AFTER `Scheduler.get_internal_state`: add the settings and counters under "vtoken"."""
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        running = getattr(scheduler, "running_batch", None)
        proc = process()
        if running is None or running.is_empty():  # the gauges describe running requests
            proc.counters.no_running()
        allocator = scheduler.token_to_kv_pool_allocator
        state["vtoken"] = {
            "config": server_config().to_dict(),
            **proc.counters.as_dict(),
            "naive_held_requests": naive_held_requests(scheduler),
            "shortages": proc.shortages.as_dict(),  # by path, forced ones apart (shortage.py)
            # free == total after load: available + evictable (radix cache) == total
            "pool_total_tokens": int(scheduler.max_total_num_tokens),
            "pool_available_tokens": int(allocator.available_size()),
            "pool_evictable_tokens": int(scheduler.tree_cache.evictable_size()),
            **(proc.tier.as_dict() if proc.tier is not None else {}),
        }
    return result


def around_is_request_level_key(
    original: Callable[[object, str], bool], streamer: object, key: str
) -> bool:
    """AROUND `SchedulerOutputStreamer.is_request_level_customized_info_key`."""
    return key == META_KEY or original(streamer, key)
