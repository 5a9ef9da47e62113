"""What an eviction step uses of its scheduler, read once per scheduler: `context_of(scheduler)`.

The step (`eviction.py`, entered from `decode.py` and `prefill.py`) reads the radix tree, the
allocator, the pool's slot table and K/V buffers, the counters, the stream the repack runs on,
the tensor-parallel group and the host tier. None of them changes after the scheduler is
built, so the context is made at the first eviction and kept on the scheduler. It also samples
the pool into the counters' gauges (`sample_held`, `sample_batch`: live tokens, retained pages,
peaks), which `/get_server_info` and Prometheus report (`surface/observe.py`,
`surface/metrics.py`).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_vtoken.pages import num_pages
from sgl_vtoken.step import KVPoolView
from sgl_vtoken.units import Words

from ..cache import host_tier
from ..core.counters import VTokenCounters
from ..core.model_support import kv_bytes_per_token
from ..core.process import process
from ..core.state import ReqEvictState, state_of
from ..core.tp import tp_gather

if TYPE_CHECKING:
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sgl_vtoken.units import Tokenizer

    from ..cache.radix import HoledRadixCache
    from ..core.sglang_types import Allocator, Req, ScheduleBatch, Scheduler, TpGroup


class DueRow(NamedTuple):
    """A request whose row reached its trigger: SGLang's `req`, its state, its live row entries."""

    req: Req
    st: ReqEvictState
    length: int


class RowOutcome(NamedTuple):
    """What evicting one due row did: tokens it `evicted` (None: left as it was, no free page for
    the copies of its kept tree-owned tokens) and the pages (slots at page size 1) to `free`."""

    evicted: int | None
    free: torch.Tensor


@dataclass(frozen=True)
class StepContext:
    """One scheduler's services for the eviction step.

    Attributes:
        tree: the radix cache (`radix.HoledRadixCache` or SGLang's own).
        allocator: SGLang's token-to-KV-pool allocator.
        view: the pool as the batched step reads and writes it (`sgl_vtoken.step.KVPoolView`).
        page_size: tokens per page.
        counters: the server-wide counters (`core/counters.py`).
        stream: the forward stream's context on CUDA (the repack runs on it), else None.
        tp_group: the tensor-parallel group (None: one rank).
        tier: the host tier (`host_tier.py`), None without one.
        total_tokens: the pool's size in tokens (SGLang's `max_total_num_tokens`), 0 unknown.
        overlap: SGLang's overlap scheduler runs (a retraction drops the step in flight, so the
            row before this step's eviction must stay recoverable: `retraction.py`).
        tokenizer: the scheduler's tokenizer (None with ``--skip-tokenizer-init``): `words`.
    """

    tree: HoledRadixCache | RadixCache
    allocator: Allocator
    view: KVPoolView
    page_size: int
    counters: VTokenCounters
    stream: AbstractContextManager[object] | None
    tp_group: TpGroup | None
    tier: host_tier.HostTier | None
    total_tokens: int
    overlap: bool = False
    tokenizer: Tokenizer | None = None

    @functools.cached_property
    def words(self) -> Words:
        """The vocabulary's word table (`sgl_vtoken.units`), read from the tokenizer at the first
        row whose policy has a `span`."""
        if self.tokenizer is None:
            raise RuntimeError(
                "span-aware keeping (EvictConfig.span) reads words from the tokenizer, which "
                "this server did not load (--skip-tokenizer-init)"
            )
        return Words.from_tokenizer(self.tokenizer)

    def sample_batch(self, batch: ScheduleBatch) -> None:
        """Live tokens, retained pages and fragmentation over the running evicting requests of
        `batch` (SGLang's `ScheduleBatch`), after this step's eviction."""
        c, ps = self.counters, self.page_size
        live = pages = running = excess = 0
        for req in batch.reqs:
            st = state_of(req)
            if st is None or not req.kv.holds_kv:
                continue
            running += 1
            cpl = req.kv.cache_protected_len
            live += req.kv.kv_committed_len
            # its own pages, the tree pages its row (or Naive-Evict's lock) references, and the
            # pages it holds back
            pages += (
                num_pages(req.kv.kv_committed_len - cpl, ps)
                + num_pages(max(cpl, st.naive.tree_lock), ps)
                + len(st.naive.held)
            )
            excess += st.naive.excess
        c.running_evicting_requests, c.live_tokens, c.retained_pages = running, live, pages
        c.naive_excess_pages = excess
        c.fragmentation = 1.0 - live / (pages * ps) if pages else 0.0
        c.peak_running_requests = max(c.peak_running_requests, batch.batch_size())
        c.peak_retained_pages = max(c.peak_retained_pages, pages)

    def sample_held(self) -> None:
        """Track the peak of pool slots held: in rows or locked radix nodes (not reclaimable)."""
        if not self.total_tokens:
            return
        held = self.total_tokens - self.allocator.available_size() - self.tree.evictable_size()
        self.counters.peak_pool_held_tokens = max(self.counters.peak_pool_held_tokens, int(held))


def context_of(scheduler: Scheduler) -> StepContext:
    """The step context of `scheduler` (an SGLang `Scheduler`), made at the first call and kept
    on the process object (`core/process.py`)."""
    proc = process()
    if proc.step is not None and proc.step.tree is scheduler.tree_cache:
        return proc.step
    allocator = scheduler.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    counters = proc.counters
    if not counters.bytes_per_token:  # a server without a policy sizes it at its first eviction
        counters.bytes_per_token = kv_bytes_per_token(kvcache)
    tp_group = getattr(scheduler, "tp_group", None)
    if tp_group is not None and tp_group.world_size == 1:
        tp_group = None
    req_to_token = scheduler.req_to_token_pool.req_to_token
    view = KVPoolView(
        req_to_token,
        kvcache.k_buffer,
        kvcache.v_buffer,
        allocator.page_size,
        tp_gather=None if tp_group is None else lambda t, dim: tp_gather(t, tp_group, dim),
    )
    proc.step = StepContext(
        tree=scheduler.tree_cache,
        allocator=allocator,
        view=view,
        page_size=allocator.page_size,
        counters=counters,
        stream=getattr(scheduler, "forward_stream_ctx", None) if req_to_token.is_cuda else None,
        tp_group=tp_group,
        tier=proc.tier,
        total_tokens=int(getattr(scheduler, "max_total_num_tokens", 0)),
        overlap=bool(getattr(scheduler, "enable_overlap", False)),
        tokenizer=getattr(scheduler, "tokenizer", None),
    )
    return proc.step
