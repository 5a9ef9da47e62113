"""Naive-Evict's held-back pages count as the request's own in SGLang's pool accounting, through
the request's own `ReqKvInfo` (no table keyed by object id)."""

import inspect

import torch
from sglang.srt.managers.schedule_batch import ReqKvInfo
from sglang.srt.managers.scheduler_components import pool_stats_observer

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step import held


class Req:
    def __init__(self):
        self.kv = ReqKvInfo()
        self.kv.swa_evict_floor = 3  # whatever SGLang set before the hook runs is kept


def test_held_pages_are_counted_through_the_requests_kv_record():
    original = inspect.unwrap(pool_stats_observer.kv_private_tokens)  # hooked once plugins load
    st = new_state(
        EvictConfig(policy="streamingllm", budget=64, page_size=16, reclaim="naive"),
        "r0",
        holed=False,
    )
    req, other = Req(), Req()
    held.count_held(req, st)
    assert isinstance(req.kv, ReqKvInfo) and req.kv.held_for is st and req.kv.swa_evict_floor == 3
    third = Req()
    held.count_held(third, st)
    assert type(third.kv) is type(req.kv)  # one subclass per SGLang class
    req.kv.kv_allocated_len = other.kv.kv_allocated_len = 40
    assert held.around_kv_private_tokens(original, req.kv, 16) == original(other.kv, 16) == 48

    st.naive.hold(torch.tensor([7, 9]), tree_lock=0, excess=0)
    assert held.around_kv_private_tokens(original, req.kv, 16) == 48 + 2 * 16
    assert held.around_kv_private_tokens(original, other.kv, 16) == 48  # a plain record: stock

    class Allocator:
        device = "cpu"
        freed = None

        def free_page_ids(self, pages):
            self.freed = pages.tolist()

    alloc = Allocator()
    req.vtoken = st
    assert held.release_held(req, alloc) == 2 and alloc.freed == [7, 9]
    assert (
        held.around_kv_private_tokens(original, req.kv, 16) == 48 and st.naive.held.tolist() == []
    )


def test_hold_naive_pages_keeps_what_naive_evict_could_not_free():
    st = new_state(
        EvictConfig(policy="streamingllm", budget=64, page_size=4, reclaim="naive"),
        "r0",
        holed=False,
    )
    kept = torch.tensor([0, 1, 9, 14])  # pages 0, 2, 3 (+ page 3 for the next token 15)
    freed = torch.tensor([5, 6, 8])
    really = held.hold_naive_pages(st, kept, 15, own_len=4, freed=freed)
    # Naive-Evict: 3 pages; compacted: 1 page -> 2 held back, the third really freed
    assert st.naive.held.tolist() == [5, 6] and really.tolist() == [8] and st.naive.excess == 0
