"""How the kernels are timed: timers, move patterns and one measurement per kernel call shape.

Each repacker or score-kernel figure is judged against the device's own copy bandwidth, measured
in the same run with the same timer (a `torch` device-to-device copy):

    repack floor       2 x moved bytes (read + write) at copy bandwidth
    score read floor   the K bytes the batch reads, read at copy bandwidth (= half a copy of them)

Timers (GPU): `median_us` is triton's `do_bench` (L2 flushed between calls, median): one call
end to end, host-bound when the host is slower; `wall_us` back-to-back calls through the public
API (validation included) per call; `host_us` the host's enqueue time per call; `graph_us` the
device time per call from CUDA-graph replays. On CPU (Triton interpreter) every timer is a
perf_counter best-of and `graph_us` is None. Used by `python -m sgl_vtoken_tools kernels`; needs torch and
triton only.
"""

from __future__ import annotations

import time

import torch

GRAPH_CALLS = 10  # calls captured per CUDA graph (per-replay launch cost amortized)


class Timers:
    """The timers of one device; `budget_ms` bounds the repetitions of each measurement."""

    def __init__(self, device: torch.device, budget_ms: float = 50.0):
        self.device, self.budget_ms = device, budget_ms
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_us(self, fn) -> float:
        if not self.cuda:
            return _best_of(fn, 3) * 1e6
        from triton.testing import do_bench

        fn()
        self.sync()
        return do_bench(fn, warmup=10, rep=self.budget_ms, return_mode="median") * 1e3

    def _reps(self, per_call_us: float) -> int:
        return int(max(3, min(50, self.budget_ms * 1e3 / max(per_call_us, 1.0))))

    def wall_us(self, fn, per_call_us: float) -> float:
        n = self._reps(per_call_us)
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / n * 1e6

    def host_us(self, fn, per_call_us: float) -> float:
        n = min(self._reps(per_call_us), 20)  # well below the launch queue's depth
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        self.sync()
        return dt / n * 1e6

    def graph_us(self, fn, per_call_us: float) -> float | None:
        if not self.cuda:
            return None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # warm up outside the graph (compilation, address tables, allocator)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()
        self.sync()
        n = max(1, self._reps(per_call_us * GRAPH_CALLS))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        self.sync()
        del graph
        return start.elapsed_time(end) * 1e3 / (n * GRAPH_CALLS)


def _best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_gbps(timers: Timers, nbytes: int) -> tuple[float, float]:
    """(time_us, GB/s counting read + write) of a device-to-device copy of `nbytes` bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timers.device)
    dst = torch.empty_like(src)
    t = timers.median_us(lambda: dst.copy_(src))
    return t, 2 * nbytes / (t * 1e-6) / 1e9


def repack_moves(pattern: str, tokens: int, num_slots: int, page: int, g: torch.Generator):
    """(src, dst) int64 CPU move lists of `tokens` moves.

    `compaction`: the planner's in-place compaction of page-dense rows of 32 pages keeping about
    half of each row (long dst <= src chains); `scatter`: random disjoint slots.
    """
    if pattern == "scatter":
        perm = torch.randperm(num_slots - page, generator=g) + page
        return perm[:tokens], perm[tokens : 2 * tokens]
    if pattern != "compaction":
        raise ValueError(f"unknown pattern {pattern!r}; choose from compaction, scatter")
    src, dst, made = [], [], 0
    pages = (torch.randperm(num_slots // page - 1, generator=g) + 1).tolist()
    while made < tokens and pages:
        row_pages, pages = pages[:32], pages[32:]
        row = (torch.tensor(row_pages)[:, None] * page + torch.arange(page)).flatten()
        kept = row[torch.rand(row.numel(), generator=g) < 0.5]
        moving = kept != row[: kept.numel()]
        src.append(kept[moving])
        dst.append(row[: kept.numel()][moving])
        made += int(moving.sum())
    if made < tokens:
        raise ValueError(f"pool of {num_slots} slots too small for {tokens} compaction moves")
    return torch.cat(src)[:tokens], torch.cat(dst)[:tokens]


def no_launch(module):
    """Context manager: `module._repack_kernel` / `_attn_scores_kernel` launches do nothing, so a
    Python-level timer sees only the host work around Triton's launch."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        names = [n for n in ("_repack_kernel", "_attn_scores_kernel") if hasattr(module, n)]
        saved = {n: getattr(module, n) for n in names}
        stubs = {
            n: type(type(k).__name__, (), {"__getitem__": lambda self, grid: _noop})
            for n, k in saved.items()
        }
        try:
            for n in names:
                setattr(module, n, stubs[n]())
            yield
        finally:
            for n, k in saved.items():
                setattr(module, n, k)

    return ctx()


def _noop(*args, **kwargs) -> None:
    return None


def repack_host_overhead(
    layers: int, heads: int, head_dim: int, dtype, device, reps: int = 2000
) -> dict:
    """Per-call host cost of `repack_kv_` outside Triton's launch (kernel stubbed), in us:
    `cached` (a validated buffer set, the steady state) and `first_call` (validation included,
    what every call cost before buffer sets were cached)."""
    from sgl_vtoken.kernels import buffer_set, repack, repack_kv_

    keys = [torch.zeros(64, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    values = [torch.zeros(64, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    src = torch.arange(8, 16, device=device)
    dst = torch.arange(0, 8, device=device)
    with no_launch(repack):
        call = lambda: repack_kv_(keys, values, src, dst, impl="triton")  # noqa: E731
        buffer_set.clear_buffer_cache()
        t0 = time.perf_counter()
        call()
        first = (time.perf_counter() - t0) * 1e6
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps // 5):
                call()
            best = min(best, (time.perf_counter() - t0) / (reps // 5) * 1e6)
    buffer_set.clear_buffer_cache()
    return dict(cached_us=best, first_call_us=first, buffers=2 * layers)
