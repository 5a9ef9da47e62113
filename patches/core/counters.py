"""Server-wide vToken counters, one set per scheduler process (reported in /get_server_info)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class VTokenCounters:
    """Cumulative since start-up, except the `live_*` and `retained_*` gauges (last step)."""

    evictions: int = 0
    evicted_tokens: int = 0
    pages_freed: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    bytes_per_token: int = 0  # K and V of every layer of one token
    running_evicting_requests: int = 0  # running requests under eviction (last step)
    live_tokens: int = 0  # live KV tokens of running evicting requests
    retained_pages: int = 0  # pages those requests hold
    fragmentation: float = 0.0  # 1 - live / (retained pages * page size)
    naive_excess_pages: int = 0  # --kv-reclaim naive: pages held beyond Naive-Evict's own
    peak_running_requests: int = 0  # largest decode batch seen
    peak_retained_pages: int = 0  # most pages evicting requests held at once
    peak_pool_held_tokens: int = 0  # most pool slots held at once (rows, locked radix nodes)
    history_hits: int = 0  # finished requests that continued from a stored history
    history_tokens_reused: int = 0  # logical tokens those requests did not prefill again
    deferred_evictions: int = 0  # decode evictions put off a step: no free page (shortage.py)
    deferred_admissions: int = 0  # admissions put off a round: no free page (shortage.py)
    shortage_aborts: int = 0  # requests ended: no free page, and none would come
    graph_eager_steps: int = (
        0  # scored decode steps run eagerly: beyond the graph's bound, or no buffers
    )

    def count_step(self, evicted: list[int | None], freed: int, moved: int) -> None:
        """An eviction step: each row's tokens `evicted` (None: left for a later step), the
        pages (slots at page size 1) it gave back in its one allocator call, the tokens moved."""
        self.pages_freed += freed
        self.evictions += sum(n is not None for n in evicted)
        self.evicted_tokens += sum(n for n in evicted if n)
        self.tokens_moved += moved
        self.bytes_moved += moved * self.bytes_per_token

    def no_running(self) -> None:
        """No evicting request runs: the last-step gauges go to zero (peaks stay)."""
        self.running_evicting_requests = self.live_tokens = self.retained_pages = (
            self.naive_excess_pages
        ) = 0
        self.fragmentation = 0.0

    def as_dict(self) -> dict:
        return asdict(self)
