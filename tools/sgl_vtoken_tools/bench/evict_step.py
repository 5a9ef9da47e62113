"""The eviction step on an SGLang-shaped fake pool: batched pass against the per-row path.

Drives the server's own step code (`sgl_vtoken.step.decide`, `step_apply.apply`) and its per-row oracle
(`sgl_vtoken_tools.step_ref.evict_row_ref`) on the same rows of the same pool, one after the other,
restoring the slot table and the K/V contents in between (untimed). Needs torch only (Triton
on CUDA); no SGLang.

    pool   req_to_token [B, L + 1] int32, page-dense rows of L = budget + interval tokens;
           one [slots, H, D] K and V tensor per layer; freed pages are appended to a free-page
           tensor with torch.cat, as SGLang's allocator does
    timed  the whole step: score, keep, plan, move, rewrite rows, free (device synchronized)
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass

import torch

import sgl_vtoken.step_apply as step_mod
import sgl_vtoken_tools.step_ref as ref_mod
from sgl_vtoken.policies import make_policy
from sgl_vtoken.policies.sharing_aware import SharingAware
from sgl_vtoken.step import EvictRow, KVPoolView, decide
from sgl_vtoken.step_apply import apply

SHAPES = {"llama8b": (32, 8, 128), "smollm2": (30, 3, 64)}  # layers, KV heads, head dim
POLICIES = ("streamingllm", "random", "knorm", "h2o", "tova", "scissorhands")


@dataclass
class Case:
    shape: str
    dtype: torch.dtype
    device: str
    policy: str
    batch: int
    budget: int
    interval: int
    page_size: int


class FakePool:
    """Rows of `budget + interval` tokens on dense pages, the K/V buffers, a free-page list."""

    def __init__(self, case: Case, seed: int = 0):
        layers, heads, dim = SHAPES[case.shape]
        ps, length = case.page_size, case.budget + case.interval
        pages_per_row = -(-length // ps)
        slots = (case.batch * pages_per_row + 1) * ps
        self.seed, self.gen = seed, torch.Generator(device=case.device)

        def buf():
            return torch.empty(slots, heads, dim, dtype=case.dtype, device=case.device)

        pages = 1 + torch.arange(case.batch * pages_per_row, device=case.device).view(
            case.batch, -1
        )
        rows = (pages[:, :, None] * ps + torch.arange(ps, device=case.device)).flatten(1)[
            :, :length
        ]
        table = torch.zeros(case.batch, length + 1, dtype=torch.int32, device=case.device)
        table[:, :length] = rows
        self.initial = table.clone()
        self.view = KVPoolView(
            table, [buf() for _ in range(layers)], [buf() for _ in range(layers)], ps
        )
        self.free_pages = torch.zeros(0, dtype=torch.int64, device=case.device)
        self.reset()
        self.bytes_per_token = (
            2 * layers * heads * dim * torch.empty(0, dtype=case.dtype).element_size()
        )
        policy = SharingAware(make_policy(case.policy, sink=4))
        offset = 1000  # tokens evicted before: positions need not start at the row index
        positions = torch.cat([torch.arange(4), torch.arange(4, length) + offset])
        stats = (
            torch.rand(length, layers, heads, generator=self.gen, device=case.device)
            if "attn" in policy.needs
            else None
        )
        self.rows = [
            EvictRow(
                row=b,
                length=length,
                positions=positions,
                policy=policy,
                budget=case.budget,
                rid=b,
                step=3,
                attn=stats,
            )
            for b in range(case.batch)
        ]

    def reset(self) -> None:
        """The pool as built: slot table, free list and K/V contents (key policies read them)."""
        self.view.req_to_token.copy_(self.initial)
        self.free_pages = self.free_pages[:0]
        self.gen.manual_seed(self.seed)
        for buf in self.view.k_buffers + self.view.v_buffers:
            buf.normal_(generator=self.gen)

    def free(self, pages: torch.Tensor) -> None:
        self.free_pages = torch.cat([self.free_pages, pages.to(self.free_pages.device)])

    def batched(self) -> int:
        d = decide(self.rows, self.view)
        out = apply(d, self.view)
        self.free(out.freed)
        return out.moved

    def per_row(self) -> int:
        moved = 0
        for r in self.rows:
            res = ref_mod.evict_row_ref(r, self.view)
            self.free(res.freed.to(self.free_pages.device))
            moved += int(res.src.numel())
        return moved


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _count_launches(fn) -> int:
    """Calls of `repack_kv_` made by `fn` (the step and the oracle import it by name)."""
    calls = []
    real = step_mod.repack_kv_

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    step_mod.repack_kv_ = ref_mod.repack_kv_ = counting
    try:
        fn()
    finally:
        step_mod.repack_kv_ = ref_mod.repack_kv_ = real
    return len(calls)


def _count_syncs(fn, device: str) -> int | None:
    """Host synchronizations `fn` makes (CUDA's sync debug mode); None off CUDA."""
    if not device.startswith("cuda"):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(case: Case, repeats: int = 5) -> list[dict]:
    """One JSON-ready line per path (batched, per_row) for `case`, the batched line with the
    per-row / batched ratio of median step times."""
    pool = FakePool(case)
    lines = []
    for path in ("batched", "per_row"):
        fn = getattr(pool, path)
        pool.reset()
        fn()  # warm-up (Triton compilation, caches)
        pool.reset()
        launches = _count_launches(fn)
        pool.reset()
        syncs = _count_syncs(fn, case.device)
        times, moved = [], 0
        for _ in range(repeats):
            pool.reset()
            _sync(case.device)
            t0 = time.perf_counter()
            moved = fn()
            _sync(case.device)
            times.append((time.perf_counter() - t0) * 1e3)
        lines.append(
            dict(
                bench="evict_step",
                path=path,
                shape=case.shape,
                dtype=str(case.dtype).removeprefix("torch."),
                device=case.device,
                policy=case.policy,
                batch=case.batch,
                budget=case.budget,
                interval=case.interval,
                page_size=case.page_size,
                repeats=repeats,
                ms_median=round(statistics.median(times), 3),
                ms_min=round(min(times), 3),
                ms_max=round(max(times), 3),
                host_syncs=syncs,
                repack_launches=launches,
                moved_tokens=moved,
                bytes_moved=moved * pool.bytes_per_token,
            )
        )
    lines[0]["speedup_vs_per_row"] = round(lines[1]["ms_median"] / lines[0]["ms_median"], 2)
    return lines
