"""An evicting row's hold on the holed radix cache's shared prompts, on a tiny fake pool (no
server): its lock moves up to what it still uses (`relock_shallower`), whole pages it keeps stay
locked at page size 16, its prompt is shared at its first eviction whenever SGLang's checkpoint
lands, and a prompt only it holds leaves the tree for its copies (`detach_own`).
docs/design/cache.md, "Shared prompts" and "Own prompt"."""

from array import array

import pytest
import torch
from helpers.fake_pool import Allocator, PagedAllocator, Req, fake_scheduler, holed_cache, match
from helpers.fake_server import FakeTokenizer

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.core import process as process_module
from sgl_vtoken_tools import forced_shortage


def test_a_row_that_dropped_a_shared_prompt_unlocks_its_unused_part():
    """relock_shallower: the lock moves up to the node covering the tokens the row still needs
    (split there); the rest of the prompt becomes evictable; nothing is freed while a lock covers it."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = holed_cache(Allocator(64))
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
