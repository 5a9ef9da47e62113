"""The holed radix cache's stored histories on a tiny fake pool (no server): exact slot
accounting, a finished row stored as a view with holes and continued, cut where a prompt differs,
punched by the next history; at page size 16 stored by pages, the last page copied on write; and
eviction of holed nodes. The step's hold on shared prompts: test_shared_prompt.py."""

from array import array

import pytest
import torch
from helpers.fake_pool import Allocator, PagedAllocator, Req, fake_scheduler, holed_cache, match

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.core import process as process_module


@pytest.fixture
def cache():
    return holed_cache(Allocator(64))


def evicting_state(rid):
    from sgl_vtoken.patches.runtime import new_state

    return new_state(EvictConfig(policy="streamingllm", budget=8, sink=2), rid, holed=True)


def finish_turn(cache, req, ids_with_kv, kept_pos):
    """Pretend `req` ran and evicted: its row holds `kept_pos` (fresh slots); store it."""
    st = req.vtoken
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(len(kept_pos))
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(kept_pos)] = slots.to(
        torch.int32
    )
    req.output_ids = array("q", ids_with_kv[len(req.origin_input_ids) :] + [999])  # last: no KV
    st.row.kept_pos, st.row.offset, st.row.steps = (
        torch.tensor(kept_pos),
        len(ids_with_kv) - len(kept_pos),
        1,
    )
    req.lock = cache.lock(req.last_node or cache.root_node)
    req.done = True
    cache.checkpoint(req, up_to=len(kept_pos))
    cache.unlock(req.lock)
    return slots


def test_history_is_stored_with_holes_and_continued(cache):
    alloc = cache.token_to_kv_pool_allocator
    ids = list(range(100, 112))  # 12 logical tokens with KV
    first = Req(ids[:6], evicting_state("a"))
    slots = finish_turn(cache, first, ids, kept_pos=[0, 1, 8, 9, 10, 11])
    assert cache.evictable_size() == 6 and cache.protected_size() == 0  # live slots only
    assert sorted(cache.all_values_flatten().tolist()) == sorted(slots.tolist())
    assert alloc.available_size() + cache.evictable_size() == alloc.size

    nxt = Req(ids + [999, 7, 8], evicting_state("b"))  # history + last token + message
    result = match(cache, nxt)
    assert result.device_prefix_len == 6
    st = nxt.vtoken
    assert st.row.kept_pos.tolist() == [0, 1, 8, 9, 10, 11] and st.row.offset == 12 - 6
    assert list(nxt.origin_input_ids) == [100, 101, 108, 109, 110, 111, 999, 7, 8]
    assert cache.prefix_device_indices(nxt).tolist() == slots.tolist()
    assert st.report.history_tokens == 12

    plain = Req(ids + [999, 7, 8])  # no eviction: never a holed hit
    assert match(cache, plain).device_prefix_len == 0

    edited = Req(ids[:9] + [5, 5, 5, 999, 7], evicting_state("c"))  # differs from position 9 on
    assert match(cache, edited).device_prefix_len == 3  # the view cut: positions 0, 1, 8
    assert (
        edited.vtoken.row.kept_pos.tolist() == [0, 1, 8]
        and edited.vtoken.report.history_tokens == 9
    )
    assert list(edited.origin_input_ids) == [100, 101, 108, 5, 5, 5, 999, 7]
    assert cache.prefix_device_indices(edited).tolist() == slots[:3].tolist()
    regenerate = Req(ids[:9], evicting_state("d"))  # ends inside the history: no cut,
    assert match(cache, regenerate).device_prefix_len == 0  # a fresh prompt (no view reused)


def test_next_history_punches_the_old_one_and_eviction_frees_only_live_slots(cache):
    alloc = cache.token_to_kv_pool_allocator
    ids = list(range(100, 112))
    finish_turn(cache, Req(ids[:6], evicting_state("a")), ids, kept_pos=[0, 1, 8, 9, 10, 11])
    turn2 = Req(ids + [999, 7, 8], evicting_state("b"))
    match(cache, turn2)
    view = cache.prefix_device_indices(turn2)
    # Turn 2's row: sinks from the old view, then its own tokens 13..16 (fresh slots).
    row = torch.cat([view[:2], alloc.alloc(4)])
    cache.req_to_token_pool.req_to_token[0, :6] = row.to(torch.int32)
    turn2.kv.cache_protected_len = 2
    st = turn2.vtoken
    turn2.origin_input_ids, st.prompt.logical = st.prompt.logical, None
    turn2.output_ids = array("q", [9, 10, 999])
    st.row.kept_pos, st.row.offset, st.row.steps = torch.tensor([0, 1, 13, 14, 15, 16]), 11, 1
    turn2.lock, turn2.done = cache.lock(turn2.last_node), True
    cache.checkpoint(turn2, up_to=6)
    cache.unlock(turn2.lock)
    # The old view's 4 slots at positions 8..11 are not used by the new view: punched (freed).
    assert cache.evictable_size() == 6 and cache.total_size() == 6
    assert alloc.available_size() + cache.evictable_size() == alloc.size
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    assert cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 6
    assert alloc.available_size() == alloc.size and cache.evictable_size() == 0


def test_page_size_16_history_is_stored_by_pages_and_the_last_page_copied_on_write(monkeypatch):
    """Page size 16: a finished evicting row is stored as a view whose node owns the row's private
    pages; the next turn matches it (key, then the tail past the last whole page), gets a
    page-aligned protected prefix, and its prefix ends in a fresh copy of the view's partial last
    page (same K/V, another page, made once). A prompt that differs inside the tail continues
    from the view cut before the first differing id; under pressure the tree frees the stored
    pages and the pool is whole again."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_vtoken.patches.runtime import new_state
    from sgl_vtoken.patches.step.context import context_of
    from sgl_vtoken.patches.step.eviction import DueRow, evict_rows

    ps, prompt_len = 16, 40
    monkeypatch.setattr(process_module, "_current", process_module.VTokenProcess(holed=True))
    alloc = PagedAllocator(32, ps)
    cache = holed_cache(alloc, ps)
    scheduler = fake_scheduler(cache)
    cfg = EvictConfig(policy="random", budget=48, sink=4, interval=1, page_size=ps)
    kbuf = alloc.pool.k_buffer[0]
    kbuf.copy_(torch.arange(kbuf.numel(), dtype=torch.float32).view_as(kbuf))  # slot-unique K
    st = new_state(cfg, "r0", holed=True)
    req = Req(list(range(1000, 1000 + prompt_len)), st)
    req.refresh_fill_ids()
    st.prefix.continue_from(None, None, prompt_len)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = prompt_len
    req.kv.swa_evict_floor, req.extend_end = 0, prompt_len
    rtt = cache.req_to_token_pool.req_to_token
    rtt[0, :prompt_len] = alloc.alloc(48)[:prompt_len].to(torch.int32)
    req.lock = cache.lock(cache.root_node)
    for t in range(30):
        row_len = req.kv.kv_committed_len
        if cfg.should_evict(row_len):
            evict_rows(context_of(scheduler), [DueRow(req, st, row_len)])
            row_len = req.kv.kv_committed_len
        rtt[0, row_len] = int(rtt[0, row_len - 1]) + 1 if row_len % ps else int(alloc.alloc(ps)[0])
        req.kv.kv_committed_len = req.kv.kv_allocated_len = row_len + 1
        req.output_ids.append(2000 + t)
    row_len = req.kv.kv_committed_len
    assert st.row.steps > 0 and row_len % ps  # evicted; the row ends in a partial page
    req.output_ids.append(3000)  # the last token: no KV
    req.done = True
    logical = list(st.prompt.logical_ids(req))
    cache.checkpoint(req, up_to=row_len)
    node = req.last_node
    positions, view = node.vt.view.positions, node.vt.view.slots
    assert len(view) == row_len and positions.tolist() == st.row.positions(row_len).tolist()
    cache.unlock(req.lock)
    assert (
        cache.total_size() == alloc.size - alloc.available_size()
    )  # the tree owns every used slot
    assert cache.evictable_size() == cache.total_size()

    turn2 = Req(logical + [5, 6, 7], new_state(cfg, "r1", holed=True))
    result = match(cache, turn2)
    assert result.device_prefix_len == row_len and result.cache_protected_len == row_len // ps * ps
    assert turn2.vtoken.report.history_tokens == len(logical) - 1
    turn2.lock = cache.lock(turn2.last_node)
    before = alloc.available_size()
    prefix = cache.prefix_device_indices(turn2)
    k = row_len % ps
    assert alloc.available_size() == before - ps  # one fresh page
    assert prefix[:-k].tolist() == view[:-k].tolist()
    assert not set((prefix[-k:] // ps).tolist()) & set((view // ps).tolist())
    assert torch.equal(kbuf[prefix[-k:]], kbuf[view[-k:]])  # the same K, copied
    assert cache.prefix_device_indices(turn2) is prefix and alloc.available_size() == before - ps
    alloc.free(torch.arange(ps) + int(prefix[-1]) // ps * ps)  # the request's own page goes
    cache.unlock(turn2.lock)

    assert (len(logical) - 1) % ps  # the view has a tail
    other = Req(logical[:-2] + [logical[-2] + 1, 3000, 5], new_state(cfg, "r2", holed=True))
    cut = len(logical) - 2  # its first differing id
    assert match(cache, other).device_prefix_len == int((positions < cut).sum())  # the view, cut
    assert other.vtoken.report.history_tokens == cut
    cache.evict(EvictParams(num_tokens=10**6))
    assert alloc.available_size() == alloc.size and cache.total_size() == 0
