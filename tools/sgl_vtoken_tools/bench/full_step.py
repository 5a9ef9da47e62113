"""The whole decode step of a batch of evicting requests, timed on a server-shaped fake.

`evict_step.py` times `sgl_vtoken.step` alone (no SGLang, runs on the GPU machine). This one
times what a server adds to a decode step at the trigger, through the real `patches/` code on
`sgl_vtoken_tools.fake_server` (so it needs SGLang): the scored forward's part (decode scoring
of every layer) and the eviction hook (statistics fold, decide, tree work, history release,
offload, repack, row write, frees), on rows built by `step_counts.build` (shared prompts; with
`history`, a second turn continuing its stored view; with `offload`, the host tier).

    line   one per shape x policy x page size x history/offload x pool x batch: median / min / max
           ms of the forward part, the eviction and both, over `repeats` fresh builds (untimed),
           and the device work of one more step counted by `dispatch_count`
"""

from __future__ import annotations

import statistics
import time

import torch

from sgl_vtoken_tools.dispatch_count import DeviceCounter, count_calls
from sgl_vtoken_tools.fake_server import Shape
from sgl_vtoken_tools.step_counts import Scenario, build

SHAPES = {
    "llama8b": Shape(layers=32, kv_heads=8, q_heads=32, head_dim=128, dtype=torch.bfloat16),
    "smollm2": Shape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype=torch.float32),
    "tiny": Shape(),
}


def measure_full(sc: Scenario, shape: str, repeats: int = 3, init_tokens: int = 8192) -> dict:
    """One JSON-ready line for scenario `sc` at `shape` (a key of SHAPES)."""
    import sgl_vtoken.decode_scores as decode_scores
    import sgl_vtoken.step_apply as step
    from sgl_vtoken.patches.core.process import process, use

    previous = process()
    fwd, ev = [], []
    try:
        for r in range(repeats + 2):  # the first builds warm caches; the last is counted
            server, reqs = build(sc, SHAPES[shape], init_tokens=init_tokens)
            if r == repeats + 1:
                with count_calls(decode_scores, "attn_scores_"), count_calls(step, "repack_kv_"):
                    with DeviceCounter() as c:
                        server.forward(reqs)
                        server.evict(reqs)
                counts = c.summary()
                break
            t0 = time.perf_counter()
            server.forward(reqs)
            t1 = time.perf_counter()
            server.evict(reqs)
            t2 = time.perf_counter()
            if r:
                fwd.append((t1 - t0) * 1e3)
                ev.append((t2 - t1) * 1e3)
            del server, reqs
    finally:
        use(previous)
    step_ms = [a + b for a, b in zip(fwd, ev)]
    return dict(
        bench="evict_step_full",
        shape=shape,
        dtype=str(SHAPES[shape].dtype).removeprefix("torch."),
        policy=sc.policy,
        page_size=sc.page_size,
        history=sc.history,
        offload=sc.offload,
        pool_tokens=sc.pool_tokens,
        batch=sc.batch,
        budget=sc.budget,
        interval=sc.interval,
        repeats=repeats,
        forward_ms=_stats(fwd),
        evict_ms=_stats(ev),
        step_ms=_stats(step_ms),
        host_syncs=counts["host_syncs"],
        score_launches=counts["calls"].get("attn_scores_", 0),
        launches=counts["launches"],
        alloc_bytes=counts["alloc_bytes"],
        max_alloc_bytes=counts["max_alloc_bytes"],
    )


def _stats(ms: list[float]) -> dict:
    return dict(
        median=round(statistics.median(ms), 3), min=round(min(ms), 3), max=round(max(ms), 3)
    )
