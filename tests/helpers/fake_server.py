"""A scheduler's share of SGLang, faked at any batch and pool size, around the real `patches/`
code: the holed radix cache, the eviction hook, decode scoring and the host tier run as in a
server; only the allocator, the slot table, the K/V pool, requests, batches and the model are
stand-ins (the model: random queries per layer, no attention output).

    server = FakeServer(Shape(...), pool_tokens=65536, page_size=16, host_tokens=0)
    req = server.admit(cfg, prompt_ids, "r0")     # match (prompt or stored view), prefill slots
    server.evict(reqs)                            # Scheduler.update_running_batch's hook
    server.decode(reqs)                           # prepare_for_decode, then a scored forward
    server.finish(req)                            # stored as a history (release_kv_cache)

The allocator hands out page-dense slots from a free list kept as a tensor, so its cost does not
grow with the pool; the K/V pool is allocated untouched (only its first `init_tokens` slots, which
the ascending free list hands out first, hold random values), so a 1M-token pool costs nothing.
What SGLang keeps on the device (the pool, the slot table, allocations, sequence lengths,
queries) is marked as such for `dispatch_count`; the stand-ins run `quiet()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from helpers.dispatch_count import mark, quiet
from helpers.fake_pool import Batch, Req, fake_scheduler, holed_cache


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    kv_heads: int = 2
    q_heads: int = 4
    head_dim: int = 16
    dtype: torch.dtype = torch.float32


class Allocator:
    """SGLang's token-to-KV-pool allocator at any page size, with the K/V pool (`get_kvcache`)."""

    def __init__(self, pool_tokens: int, page_size: int, shape: Shape, init_tokens: int = 1 << 16):
        ps = self.page_size = page_size
        self.device, self.size = "cpu", pool_tokens
        self.free_pages = torch.arange(1, pool_tokens // ps + 1)  # page 0 is SGLang's padding page
        slots = (pool_tokens // ps + 1) * ps
        buf = [
            torch.empty(slots, shape.kv_heads, shape.head_dim, dtype=shape.dtype)
            for _ in range(2 * shape.layers)
        ]
        g = torch.Generator().manual_seed(0)
        for t in (
            buf
        ):  # the slots rows use first (the free list is ascending); the rest is never touched
            t[:init_tokens].normal_(generator=g)
        self.pool = SimpleNamespace(
            k_buffer=buf[: shape.layers],
            v_buffer=buf[shape.layers :],
            layer_num=shape.layers,
            head_num=shape.kv_heads,
            get_key_buffer=lambda layer: buf[layer],
        )
        mark(*buf)

    def get_kvcache(self):
        return self.pool

    def available_size(self) -> int:
        return int(self.free_pages.numel()) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        with quiet():
            ps = self.page_size
            k = -(-n // ps)
            if k > self.free_pages.numel():
                return None
            pages, self.free_pages = self.free_pages[:k], self.free_pages[k:]
            out = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
        return mark(out)

    def free_page_ids(self, pages: torch.Tensor) -> None:
        with quiet():
            self.free_pages = torch.cat([self.free_pages, pages.to(torch.int64).cpu()])

    def free(self, slots: torch.Tensor) -> None:
        with quiet():
            self.free_page_ids(torch.unique(slots.to(torch.int64).cpu() // self.page_size))

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.free(slots)


class ReqToTokenPool:
    """SGLang's request-to-token table: ``req_to_token [rows, max_ctx]`` int32 slots."""

    def __init__(self, rows: int, max_ctx: int):
        self.req_to_token = mark(torch.zeros(rows, max_ctx, dtype=torch.int32))

    def write(self, index, values) -> None:
        self.req_to_token[index] = values.to(torch.int32)


class FakeTokenizer:
    """The vocabulary a span reads (`sgl_vtoken.units.Words.from_tokenizer`): 65,536 ids whose
    texts cycle through a word piece, a digit, a word with its space and a full stop, so every
    row has units of one to three tokens."""

    TEXTS = ("ab", "1", " c", ".")

    def __len__(self) -> int:
        return 1 << 16

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [self.TEXTS[i[0] % len(self.TEXTS)] for i in ids]


class FakeServer:
    """One scheduler process: the real holed radix cache and hooks over `Allocator`."""

    def __init__(
        self,
        shape: Shape,
        *,
        pool_tokens: int,
        page_size: int,
        max_reqs: int = 256,
        max_ctx: int = 2048,
        host_tokens: int = 0,
        init_tokens: int = 1 << 16,
    ):
        from sgl_vtoken.patches.cache.host_tier import HostTier
        from sgl_vtoken.patches.core.process import start

        # A `--kv-evict` scheduler's process object (callers put theirs back: `process.use`).
        start(holed=True, tier=HostTier(host_tokens) if host_tokens else None)
        self.shape, self.page_size = shape, page_size
        self.alloc = Allocator(pool_tokens, page_size, shape, init_tokens)
        rtt = ReqToTokenPool(max_reqs, max_ctx)
        self.cache = holed_cache(self.alloc, page_size, rtt)
        self.scheduler = fake_scheduler(
            self.cache,
            page_size=page_size,
            max_total_num_tokens=pool_tokens,
            _reqs_finishing_inflight=lambda batch: [],
            waiting_queue=[],
            max_running_requests=max_reqs,
            tokenizer=FakeTokenizer(),
        )
        self.model_runner = SimpleNamespace(token_to_kv_pool=self.alloc.pool, req_to_token_pool=rtt)
        self.layers = [
            SimpleNamespace(
                layer_id=i,
                tp_q_head_num=shape.q_heads,
                tp_k_head_num=shape.kv_heads,
                qk_head_dim=shape.head_dim,
                scaling=shape.head_dim**-0.5,
            )
            for i in range(shape.layers)
        ]
        self.rows = list(range(max_reqs - 1, -1, -1))  # free req_to_token rows
        self._q: dict[int, list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.scheduler.req_to_token_pool.req_to_token

    # --- a request's life -----------------------------------------------------------------------
    def admit(self, cfg, ids: list[int], rid: str):
        """Admit and prefill a request evicting under `cfg`: its prompt matched in the tree (a
        shared prompt, or a stored history it continues), the rest given fresh slots."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from sgl_vtoken.patches import runtime
        from sgl_vtoken.patches.cache import host_recall, radix
        from sgl_vtoken.patches.core.process import process

        st = runtime.new_state(cfg, rid, holed=radix.tree_mode(cfg))
        req = Req(ids, st, idx=self.rows.pop())
        req.rid = rid
        req.refresh_fill_ids()
        result = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(req.full_untruncated_fill_ids, None), req=req)
        )
        req.last_node, req.prefix_len = result.last_device_node, result.device_prefix_len
        req.lock = self.cache.lock(req.last_node)
        prefix = self.cache.prefix_device_indices(req).to(torch.int64)
        n = len(req.full_untruncated_fill_ids)
        row = torch.cat([prefix, self._slots(prefix, n - prefix.numel())])
        self.req_to_token[req.kv.req_pool_idx, :n] = row.to(torch.int32)
        req.kv.cache_protected_len = (
            result.cache_protected_len
            if result.cache_protected_len is not None
            else result.device_prefix_len
        )
        req.kv.kv_committed_len = req.kv.kv_allocated_len = req.extend_end = n
        req.kv.swa_evict_floor, req.kv.holds_kv = 0, True
        if process().tier is not None:
            host_recall.begin_turn(req, st)
        if st.stats.accumulator is not None:  # the prompt's observation window, any values
            shape = (1, n, self.shape.layers, self.shape.kv_heads)
            st.stats.accumulator.update(mark(torch.rand(shape, generator=self.gen)))
        return req

    def evict(self, reqs: list) -> None:
        """`Scheduler.update_running_batch`'s hook on a batch of `reqs` (decode resumes after it)."""
        from sgl_vtoken.patches import runtime

        runtime.around_update_running_batch(lambda s, b: None, self.scheduler, self._batch(reqs))

    def decode(self, reqs: list, *, forward: bool = True) -> None:
        """One decode step: each row gets the slot of its next token, then the forward scores."""
        for req in reqs:
            n = req.kv.kv_committed_len
            row = self.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
            self.req_to_token[req.kv.req_pool_idx, n] = self._slots(row, 1)[0].to(torch.int32)
            req.kv.kv_committed_len = req.kv.kv_allocated_len = n + 1
            req.output_ids.append(50_000 + n)
            req.refresh_fill_ids()
        if forward:
            self.forward(reqs)

    def forward(self, reqs: list) -> None:
        """The decode forward's part that is ours: scoring, after each layer's attention."""
        from sgl_vtoken.patches.step import scores

        batch = self._batch(reqs)
        fb = SimpleNamespace(
            forward_mode=SimpleNamespace(is_decode=lambda: True),
            batch_size=len(reqs),
            seq_lens_cpu=batch.seq_lens_cpu,
            extend_seq_lens_cpu=None,
        )
        scored = scores.scored_requests(batch)
        if not scored:
            scores.clear()
            return
        scores.prepare(fb, scored, self.model_runner)
        real, scores.get_token_to_kv_pool = scores.get_token_to_kv_pool, lambda: self.alloc.pool
        try:
            for layer, q in zip(self.layers, self._queries(len(reqs))):
                scores.around_radix_attention_forward(
                    lambda *a, **k: None, layer, q, None, None, fb
                )
        finally:
            scores.get_token_to_kv_pool = real

    def finish(self, req) -> None:
        """The request ends (its last token has no KV): `release_kv_cache` with a checkpoint."""
        from sgl_vtoken.patches import runtime

        req.output_ids.append(60_000)
        req.done = True
        runtime.before_release_kv_cache(req, self.cache)
        req.refresh_fill_ids()
        n, cpl = req.kv.kv_committed_len, req.kv.cache_protected_len
        self.cache.checkpoint(req, up_to=n)
        cpl = req.kv.cache_protected_len
        if n > cpl:  # its own slots the tree did not take
            self.alloc.free(self.req_to_token[req.kv.req_pool_idx, cpl:n].to(torch.int64))
        self.cache.unlock(req.lock)
        req.lock, req.kv.holds_kv = None, False
        runtime.after_release_kv_cache(None, req, self.cache)
        self.rows.append(req.kv.req_pool_idx)

    def check(self, reqs: list) -> None:
        """Every page of the pool is free, in the radix tree or in a running row, and no free page
        is used or freed twice (AssertionError naming the pages otherwise)."""
        with quiet():
            ps, free = self.page_size, self.alloc.free_pages.tolist()
            assert len(set(free)) == len(free), "a page was freed twice"
            tree = set((self.cache.all_values_flatten() // ps).tolist())
            rows = set()  # with the pages a Naive-Evict emulation holds back
            for r in reqs:
                rows |= set(
                    (
                        self.req_to_token[r.kv.req_pool_idx, : r.kv.kv_committed_len].long() // ps
                    ).tolist()
                )
                rows |= set(r.vtoken.naive.held.tolist())
            assert not (tree | rows) & set(free), (
                f"free pages in use: {sorted((tree | rows) & set(free))[:8]}"
            )
            lost = set(range(1, self.alloc.size // ps + 1)) - set(free) - tree - rows
            assert not lost, f"{len(lost)} pages leaked, e.g. {sorted(lost)[:8]}"

    # --- helpers --------------------------------------------------------------------------------
    def _slots(self, row: torch.Tensor, count: int) -> torch.Tensor:
        """`count` slots after `row`, page-dense: the rest of its last page, then fresh pages."""
        ps = self.page_size
        room = min(count, (ps - row.numel() % ps) % ps) if row.numel() else 0
        head = int(row[-1]) + 1 + torch.arange(room) if room else torch.zeros(0, dtype=torch.int64)
        rest = count - room
        fresh = self.alloc.alloc(-(-rest // ps) * ps)[:rest] if rest else head[:0]
        if fresh is None:
            raise RuntimeError("the fake pool is full")
        return mark(torch.cat([head, fresh]))

    def _batch(self, reqs: list) -> Batch:
        batch = Batch(reqs, [r.kv.kv_committed_len for r in reqs])
        mark(batch.seq_lens, batch.orig_seq_lens)
        return batch

    def _queries(self, bs: int) -> list[torch.Tensor]:
        if bs not in self._q:
            g = torch.Generator().manual_seed(bs)
            s = self.shape
            self._q[bs] = [
                mark(torch.randn(bs, s.q_heads * s.head_dim, generator=g).to(s.dtype))
                for _ in range(s.layers)
            ]
        return self._q[bs]
