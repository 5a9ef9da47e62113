"""A fake of the SGLang objects the holed radix cache and the eviction step touch: a slot
allocator (page size 1, or whole pages with a one-layer K/V pool), the request-to-token table,
a request, a decode batch, and the scheduler's part the step reads; with the real holed cache
over them (`holed_cache`) and SGLang's match around it (`match`). Tests drive the real
`patches/` code on them without a server."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import torch


class Allocator:
    """A page-size-1 pool of `size` slots (1-based, like SGLang's) that rejects double frees."""

    page_size, device = 1, "cpu"

    def __init__(self, size: int):
        self.size, self.free_slots = size, list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int) -> torch.Tensor:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        for s in slots.tolist():
            assert s not in self.free_slots, f"double free of slot {s}"
            self.free_slots.append(s)

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.free(slots)


class ReqToToken:
    def __init__(self):
        self.req_to_token = torch.zeros(4, 256, dtype=torch.int32)

    def write(self, index, values):
        self.req_to_token[index] = values.to(torch.int32)


class KV:
    def __init__(self, idx: int):
        self.req_pool_idx, self.cache_protected_len, self.cache_inserted_len = idx, 0, 0
        self.holds_kv = False  # a row is registered (`fake_server` admits and releases)


class Req:
    """The attributes of SGLang's `Req` the cache reads and writes."""

    def __init__(self, ids, st=None, idx=0):
        self.origin_input_ids, self.output_ids = array("q", ids), array("q")
        self.full_untruncated_fill_ids = array("q")
        self.vtoken, self.kv, self.extra_key, self.cache_salt, self.priority = (
            st,
            KV(idx),
            None,
            None,
            0,
        )
        self.return_logprob, self.logprob_start_len, self.lock, self.last_node = (
            False,
            -1,
            None,
            None,
        )
        self.done = False

    def refresh_fill_ids(self):
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids

    def _compute_max_prefix_len(self, n):
        return n - 1

    def finished(self):
        return self.done


class PagedAllocator(Allocator):
    """`Allocator` in whole pages, with the K/V pool the eviction step reads and moves."""

    def __init__(self, pages: int, page_size: int):
        super().__init__(pages * page_size)
        self.page_size = page_size
        self.free_slots = list(range(page_size, (pages + 1) * page_size))  # page 0 is reserved
        self.pool = type(
            "Pool",
            (),
            {
                "layer_num": 1,
                "k_buffer": [torch.zeros(pages * page_size + page_size, 1, 2)],
                "v_buffer": [torch.zeros(pages * page_size + page_size, 1, 2)],
            },
        )()
        self.pool.get_key_buffer = lambda layer: self.pool.k_buffer[layer]

    def get_kvcache(self):
        return self.pool

    def alloc(self, n: int) -> torch.Tensor:
        assert n % self.page_size == 0
        return super().alloc(n)

    def free_page_ids(self, pages: torch.Tensor) -> None:
        ps = self.page_size
        self.free((pages[:, None] * ps + torch.arange(ps)).flatten())

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.free(slots)


class Batch:
    """The attributes of SGLang's `ScheduleBatch` the eviction hook reads and writes: `reqs`
    whose rows hold `lengths` tokens."""

    def __init__(self, reqs, lengths: list[int]):
        self.reqs, self.batch_is_full = reqs, False
        self.seq_lens_cpu = torch.tensor(lengths)
        self.seq_lens, self.orig_seq_lens = self.seq_lens_cpu.clone(), self.seq_lens_cpu.clone()
        self.seq_lens_sum = sum(lengths)

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)


def holed_cache(alloc, ps: int = 1, req_to_token_pool=None):
    """A holed radix cache over the fake allocator `alloc` at page size `ps`, with the slot table
    `req_to_token_pool` (default a small `ReqToToken`)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from sgl_vtoken.patches.cache import radix

    return radix.HoledRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=req_to_token_pool or ReqToToken(),
            token_to_kv_pool_allocator=alloc,
            page_size=ps,
        )
    )


def fake_scheduler(cache, **more):
    """What the eviction step reads of a scheduler (`step/context.context_of`) over `cache`, with
    the attributes `more`."""
    return SimpleNamespace(
        tree_cache=cache,
        req_to_token_pool=cache.req_to_token_pool,
        token_to_kv_pool_allocator=cache.token_to_kv_pool_allocator,
        **more,
    )


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
