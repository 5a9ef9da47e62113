"""The holed radix cache on a tiny fake pool (no server): exact slot accounting, stored views,
namespaces, hole punching and eviction of holed nodes."""

from array import array

import pytest
import torch
from helpers.fake_pool import Allocator, PagedAllocator, Req, ReqToToken
from helpers.fake_server import FakeTokenizer

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.core import process as process_module
from sgl_vtoken_tools import forced_shortage


def holed_cache(alloc, ps: int = 1):
    """A holed radix cache over the fake allocator `alloc` at page size `ps`."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_vtoken.patches.cache import radix

    return radix.HoledRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToToken(),
            token_to_kv_pool_allocator=alloc,
            page_size=ps,
        )
    )


def fake_scheduler(cache, **more):
    """What the eviction step reads of a scheduler (`step/context.context_of`) over `cache`."""
    return type(
        "Scheduler",
        (),
        {
            "tree_cache": cache,
            "req_to_token_pool": cache.req_to_token_pool,
            "token_to_kv_pool_allocator": cache.token_to_kv_pool_allocator,
            **more,
        },
    )()


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


def match(cache, req):
    """What SGLang's `match_kv_cache` does around `match_prefix`."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    req.refresh_fill_ids()
    result = cache.match_prefix(
        MatchPrefixParams(key=RadixKey(req.full_untruncated_fill_ids, None), req=req)
    )
    req.last_node = result.last_device_node
    return result


def test_a_row_that_dropped_a_shared_prompt_unlocks_its_unused_part(cache):
    """relock_shallower: the lock moves up to the node covering the tokens the row still needs
    (split there); the rest of the prompt becomes evictable; nothing is freed while a lock covers it."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(10)
    cache.insert(InsertParams(key=RadixKey(array("q", range(200, 210)), None), value=slots))
    req = Req(list(range(200, 212)))
    req.last_node = match(cache, req).last_device_node
    req.lock = cache.lock(req.last_node)
    assert cache.protected_size() == 10 and cache.evictable_size() == 0
    cache.relock_shallower(req, 4)  # the row keeps prompt tokens 0, 1, 3
    assert cache.protected_size() == 4 and cache.evictable_size() == 6
    assert cache.path_device_indices(req.last_node).tolist() == slots[:4].tolist()
    cache.unlock(req.lock)
    assert cache.evictable_size() == 10 and alloc.available_size() + 10 == alloc.size


@pytest.mark.parametrize("policy", ["streamingllm", "random", "h2o"])
def test_tree_pages_a_row_still_uses_stay_locked_at_page_size_16(policy, monkeypatch):
    """Page size 16: a decoding request keeps whole shared prompt pages that need not be a
    prefix of the prompt (sinks, then a later run of pages). Under memory pressure the tree
    frees every unlocked node, so after each eviction none of the row's slots may be free:
    the lock must reach the last whole page the row still references, not just as many tokens
    as it keeps."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_vtoken.patches.cache import radix
    from sgl_vtoken.patches.runtime import new_state
    from sgl_vtoken.patches.step.context import context_of
    from sgl_vtoken.patches.step.eviction import DueRow, evict_rows

    ps, prompt_len, steps = 16, 128, 120
    monkeypatch.setattr(process_module, "_current", process_module.VTokenProcess(holed=True))
    alloc = PagedAllocator(64, ps)
    cache = holed_cache(alloc, ps)
    # h2o keeps words whole (span 8, its default): the step reads the tokenizer
    scheduler = fake_scheduler(cache, tokenizer=FakeTokenizer())
    cfg = EvictConfig(
        policy=policy,
        budget=96,
        sink=16,
        interval=16,
        page_size=ps,
        window=16 if policy == "h2o" else 0,
    )
    st = new_state(cfg, "r0", holed=radix.tree_mode(cfg))
    assert st.holed
    req = Req(list(range(1000, 1000 + prompt_len)), st)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = prompt_len
    req.kv.swa_evict_floor, req.extend_end = 0, prompt_len
    req.refresh_fill_ids()
    rtt = cache.req_to_token_pool.req_to_token
    rtt[0, :prompt_len] = alloc.alloc(prompt_len).to(torch.int32)
    gen = torch.Generator().manual_seed(0)
    if st.stats.accumulator is not None:  # attention of the prompt's last query: any seeded values
        st.stats.accumulator.update(torch.rand(1, prompt_len, 1, 1, generator=gen))
    evictions = 0
    for t in range(steps):
        row_len = req.kv.kv_committed_len
        if row_len >= cfg.budget + cfg.interval:
            evictions += (evict_rows(context_of(scheduler), [DueRow(req, st, row_len)])[0] or 0) > 0
            cache.evict(EvictParams(num_tokens=10**6))  # memory pressure: every unlocked node goes
            row = rtt[0, : req.kv.kv_committed_len].tolist()
            assert not set(row) & set(alloc.free_slots), f"step {t}: the row uses freed slots"
            row_len = req.kv.kv_committed_len
        slot = int(rtt[0, row_len - 1]) + 1 if row_len % ps else int(alloc.alloc(ps)[0])
        rtt[0, row_len] = slot
        req.kv.kv_committed_len = req.kv.kv_allocated_len = row_len + 1
        req.output_ids.append(2000 + t)
        req.refresh_fill_ids()
        if st.stats.accumulator is not None:
            st.stats.accumulator.update(torch.rand(1, row_len + 1, 1, 1, generator=gen))
    assert evictions >= 5


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


@pytest.mark.parametrize("ps", [1, 16])
def test_the_prompt_is_shared_at_the_first_eviction_whenever_sglangs_checkpoint_lands(
    ps, monkeypatch
):
    """Under the overlap scheduler SGLang inserts a prefilled prompt into the tree only when it
    processes the prefill's result, after the next step (whose eviction may already change the
    row) began. The first eviction shares the prompt itself, so a request with the same prompt
    matches all of it right after, and SGLang's late checkpoint changes nothing: sharing does not
    depend on which came first."""

    from sgl_vtoken.patches.cache import radix
    from sgl_vtoken.patches.runtime import new_state
    from sgl_vtoken.patches.step.context import context_of
    from sgl_vtoken.patches.step.eviction import DueRow, evict_rows

    prompt_len = 128
    monkeypatch.setattr(process_module, "_current", process_module.VTokenProcess(holed=True))
    alloc = PagedAllocator(512 // ps, ps)
    cache = holed_cache(alloc, ps)
    scheduler = fake_scheduler(cache)
    cfg = EvictConfig(policy="streamingllm", budget=64, sink=4, interval=16, page_size=ps)
    st = new_state(cfg, "r0", holed=radix.tree_mode(cfg))
    prompt = list(range(1000, 1000 + prompt_len))
    req = Req(prompt, st)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = prompt_len
    req.kv.swa_evict_floor, req.extend_end = 0, prompt_len
    req.refresh_fill_ids()
    cache.req_to_token_pool.req_to_token[0, :prompt_len] = alloc.alloc(prompt_len).to(torch.int32)
    assert cache.total_size() == 0  # SGLang's prefill checkpoint has not landed
    st.retract.start_step(st.stats.snapshot())  # as evict_batch does
    assert (
        evict_rows(context_of(scheduler), [DueRow(req, st, prompt_len)])[0]
        == prompt_len - cfg.budget
    )
    assert cache.total_size() == prompt_len
    other = Req(prompt + [7])
    assert match(cache, other).device_prefix_len == prompt_len
    lock, cpl = req.lock, req.kv.cache_protected_len
    cache.checkpoint(req, up_to=prompt_len)  # SGLang's, late
    assert (
        cache.total_size() == prompt_len and req.lock is lock and req.kv.cache_protected_len == cpl
    )


@pytest.mark.parametrize("ps", [1, 16])
def test_an_own_prompt_takes_its_copies_when_no_page_is_free(ps, monkeypatch):
    """The first eviction of a row whose whole prompt is its own (nothing was cached at its
    match), with every page for the copies of what it keeps refused: its prompt leaves the tree
    (`detach_own`) and the kept entries are packed onto the prompt's first slots or pages
    (`apply`'s `onto_own`), the rest of the prompt freed with the step's pages. The row evicts
    at this step, every kept entry reads its K/V as before, and no slot is lost or freed twice."""

    from sgl_vtoken.patches.cache import pool
    from sgl_vtoken.patches.runtime import new_state
    from sgl_vtoken.patches.step.context import context_of
    from sgl_vtoken.patches.step.eviction import DueRow, evict_rows

    prompt_len, extra = 128, 32
    proc = process_module.VTokenProcess(holed=True)
    monkeypatch.setattr(process_module, "_current", proc)
    alloc = PagedAllocator(64, ps) if ps > 1 else Allocator(64 * 16)
    if ps == 1:  # the page-1 fake has no K/V pool: the paged one's, read the same way
        alloc.pool = PagedAllocator(64 * 16, 1).pool
        alloc.get_kvcache = lambda: alloc.pool
    cache = holed_cache(alloc, ps)
    scheduler = fake_scheduler(cache)
    cfg = EvictConfig(policy="streamingllm", budget=64, sink=16, interval=16, page_size=ps)
    st = new_state(cfg, "dcopies-r0", holed=True)
    req = Req(list(range(1000, 1000 + prompt_len)), st)
    req.rid = "dcopies-r0"  # its pages for copies are refused
    monkeypatch.setattr(pool, "alloc", forced_shortage.refusing_alloc(pool.alloc, "d"))
    row_len = prompt_len + extra
    req.output_ids = array("q", range(2000, 2000 + extra))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = row_len
    req.kv.swa_evict_floor, req.extend_end = 0, prompt_len
    req.refresh_fill_ids()
    st.prefix.matched = 0  # the tree held none of its prompt when it was matched
    rtt = cache.req_to_token_pool.req_to_token
    slots = alloc.alloc(row_len)
    rtt[0, :row_len] = slots.to(torch.int32)
    k, v = alloc.get_kvcache().k_buffer[0], alloc.get_kvcache().v_buffer[0]
    k[slots] = slots[:, None, None].float()
    v[slots] = -slots[:, None, None].float()
    total = alloc.available_size() + row_len
    st.retract.start_step(st.stats.snapshot())  # as evict_batch does

    (evicted,) = evict_rows(context_of(scheduler), [DueRow(req, st, row_len)])

    assert evicted == row_len - cfg.budget
    assert req.kv.kv_committed_len == cfg.budget and req.kv.cache_protected_len == 0
    kept = torch.cat(
        [torch.arange(cfg.sink), torch.arange(row_len - (cfg.budget - cfg.sink), row_len)]
    )
    row = rtt[0, : cfg.budget].to(torch.int64)
    assert torch.equal(k[row, 0, 0], slots[kept].float())
    assert torch.equal(v[row, 0, 0], -slots[kept].float())
    assert not set(row.tolist()) & set(alloc.free_slots), "the row reads a freed slot"
    assert len(set(row.tolist())) == cfg.budget
    held = -(-cfg.budget // ps) * ps  # its own pages now (the prompt left the tree)
    assert cache.evictable_size() == cache.protected_size() == 0
    assert alloc.available_size() + held == total, "a slot lost"
    assert proc.counters.evictions == 1 and proc.counters.deferred_evictions == 0
