"""The kernel benchmark's workloads: one function per part, each measurement through `measure`.

`measure(what, fn)` (from `python -m sgl_vtoken_tools kernels`) records `what` plus the dict `fn` returns,
or the error `fn` raised, so one failing measurement never ends a run. Shapes come from the
command line (`args`); timers and floors from `kernel_bench.py`.
"""

from __future__ import annotations

import math

import torch

from sgl_vtoken.kernels import attn_lse_ref, attn_scores_, page_indices, repack_kv_
from sgl_vtoken_tools.kernel_bench import copy_gbps, repack_moves

# (block_moves, num_warps, col_block): around the whole-head default (the split heads were swept before)
REPACK_SWEEP = [(bm, nw, 128) for bm in (64, 128, 256) for nw in (4, 8)]
REPACK_SWEEP_TOKENS = (1024, 16384, 65536)
# (block_n, num_warps, num_stages) around the default (16 tokens x 8 KV heads, 4 warps, 3 stages)
SCORE_SWEEP = [(8, 4, 2), (8, 4, 3), (16, 4, 1), (16, 4, 2), (16, 4, 3), (16, 8, 2), (16, 8, 3), (32, 4, 2),
               (32, 8, 2), (32, 8, 1)]  # fmt: skip


def _sweeps(args) -> dict:
    """What --sweep covers: the full grids on a GPU, two points each at smoke shapes (CPU)."""
    if args.cpu_smoke:
        return dict(repack=REPACK_SWEEP[:2], repack_tokens=(max(args.tokens),), scores=[(16, 4, 1), (32, 4, 1)],
                    score_shape=args.score_shapes[0])  # fmt: skip
    return dict(
        repack=REPACK_SWEEP,
        repack_tokens=REPACK_SWEEP_TOKENS,
        scores=SCORE_SWEEP,
        score_shape=(64, 2048),
    )


def _timings(timers, fn, floor_us: float, full: bool) -> dict:
    """do_bench time, and with `full` API wall / host / CUDA-graph time per call, vs a floor."""
    t = timers.median_us(fn)
    rec = dict(time_us=t, frac_of_floor=floor_us / t)
    if full:
        rec.update(api_wall_us=timers.wall_us(fn, t), host_us=timers.host_us(fn, t))
        g = timers.graph_us(fn, t)
        rec.update(graph_us=g, graph_frac_of_floor=None if g is None else floor_us / g)
    return rec


def repack_part(args, timers, dtype, g, measure) -> None:
    """repack_kv_ on an SGLang-shaped pool (one tensor per layer) per move count and pattern."""
    device = timers.device
    elem = torch.empty(0, dtype=dtype).element_size()
    bytes_per_token = 2 * args.layers * args.kv_heads * args.head_dim * elem  # K and V, every layer
    num_slots = _round_up(3 * max(args.tokens) + 64 * args.page_size, args.page_size)
    shape = (num_slots, args.kv_heads, args.head_dim)
    keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(args.layers)]
    values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(args.layers)]
    for t in keys + values:  # arbitrary bytes; copies do not care
        t.view(torch.uint8).random_(0, 256)
    common = dict(kernel="repack_kv", layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype)  # fmt: skip
    sweeps = _sweeps(args)
    for tokens in args.tokens:
        if args.sweep_only and tokens not in sweeps["repack_tokens"]:
            continue
        copy = {}

        def run_copy():
            copy["us"], copy["gbps"] = copy_gbps(timers, tokens * bytes_per_token)
            return dict(
                time_us=copy["us"], gbps=copy["gbps"], bytes_rw=2 * tokens * bytes_per_token
            )

        measure(dict(kernel="d2d_copy", tokens=tokens), run_copy)
        if "us" not in copy:
            continue
        floor_us = copy["us"]  # a copy moves the same bytes the repack must read and write
        for pattern in args.patterns:
            src, dst = (
                t.to(device) for t in repack_moves(pattern, tokens, num_slots, args.page_size, g)
            )
            configs = (
                []
                if args.sweep_only
                else [("triton", None, None, None), ("torch", None, None, None)]
            )
            if args.sweep and tokens in sweeps["repack_tokens"] and pattern == "compaction":
                configs += [("triton", *c) for c in sweeps["repack"]]
            if not configs:
                continue
            for impl, bm, nw, cb in configs:

                def fn(impl=impl, bm=bm, nw=nw, cb=cb):
                    repack_kv_(
                        keys,
                        values,
                        src,
                        dst,
                        impl=impl,
                        block_moves=bm,
                        num_warps=nw,
                        col_block=cb,
                    )

                full = impl == "triton" and bm is None
                what = dict(common, impl=impl, pattern=pattern, tokens=tokens, block_moves=bm, num_warps=nw,
                            col_block=cb, sweep=bm is not None, copy_gbps=copy["gbps"])  # fmt: skip
                measure(
                    what,
                    lambda fn=fn, full=full: _repack_record(timers, fn, floor_us, tokens, full),
                )


def _repack_record(timers, fn, floor_us, tokens, full) -> dict:
    rec = _timings(timers, fn, floor_us, full)
    rec["frac_of_copy"] = rec.pop("frac_of_floor")
    if "graph_frac_of_floor" in rec:
        rec["graph_frac_of_copy"] = rec.pop("graph_frac_of_floor")
    rec["us_per_1k_tokens"] = rec["time_us"] * 1000 / tokens
    rec["floor_us_per_1k_tokens"] = floor_us * 1000 / tokens
    return rec


def page_index_part(args, timers, g, measure) -> None:
    """page_indices at a serving-like batch (FlashInfer's paged CSR from req_to_token)."""
    device, page = timers.device, args.page_size
    bs, ctx = (4, 64) if args.cpu_smoke else (256, 4096)
    pages_per_row = ctx // page
    perm = torch.randperm(bs * pages_per_row + 1, generator=g)[: bs * pages_per_row] + 1
    table = (
        (perm.view(bs, pages_per_row, 1) * page + torch.arange(page))
        .view(bs, ctx)
        .to(torch.int32)
        .to(device)
    )
    rpi = torch.arange(bs, dtype=torch.int64, device=device)
    lens = torch.randint(ctx // 2, ctx + 1, (bs,), generator=g).to(device)
    num_pages = int(((lens + page - 1) // page).sum())
    for impl in ("torch", "triton"):
        measure(dict(kernel="page_indices", impl=impl, bs=bs, page_size=page, pages=num_pages),
                lambda impl=impl: dict(time_us=timers.median_us(
                    lambda: page_indices(table, rpi, lens, page, num_pages=num_pages, impl=impl))))  # fmt: skip


def score_part(args, timers, dtype, g, measure) -> None:
    """attn_scores_ (one layer) per batch x context, random slot order, vs its K read floor."""
    device = timers.device
    qk_dtype = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
    copy = {}

    def run_copy():  # the floor: K bytes read at the copy bandwidth of a large copy
        copy["us"], copy["gbps"] = copy_gbps(timers, (1 << 20) if args.cpu_smoke else (1 << 30))
        return dict(
            time_us=copy["us"],
            gbps=copy["gbps"],
            bytes_rw=2 * ((1 << 20) if args.cpu_smoke else (1 << 30)),
        )

    measure(dict(kernel="d2d_copy", part="score_floor"), run_copy)
    if "gbps" not in copy:
        return
    sm_scale = 1.0 / math.sqrt(args.head_dim)
    sweeps = _sweeps(args)
    for bs, ctx in args.score_shapes:
        if args.sweep_only and (bs, ctx) != sweeps["score_shape"]:
            continue
        state = {}

        def setup(bs=bs, ctx=ctx):
            num_slots = bs * ctx + 1
            state["q"] = (
                torch.randn(bs, args.q_heads, args.head_dim, generator=g).to(qk_dtype).to(device)
            )
            gd = torch.Generator(device=device).manual_seed(
                int(torch.randint(0, 2**62, (1,), generator=g))
            )
            state["k"] = torch.randn(
                num_slots, args.kv_heads, args.head_dim, generator=gd, device=device
            ).to(qk_dtype)
            state["indptr"] = torch.arange(0, bs * ctx + 1, ctx, dtype=torch.int32, device=device)
            state["idx"] = (
                (torch.randperm(num_slots - 1, generator=g) + 1).to(torch.int32).to(device)
            )
            state["lse"] = attn_lse_ref(
                state["q"], state["k"], state["indptr"], state["idx"], sm_scale
            )
            state["k_bytes"] = bs * ctx * args.kv_heads * args.head_dim * state["k"].element_size()
            state["floor_us"] = state["k_bytes"] / (copy["gbps"] * 1e9) * 1e6
            return dict(k_bytes=state["k_bytes"], floor_us=state["floor_us"])

        what = dict(kernel="attn_scores", bs=bs, ctx=ctx, q_heads=args.q_heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim)  # fmt: skip
        measure(dict(what, part="setup"), setup)
        if "floor_us" not in state:
            continue
        runs = (
            []
            if args.sweep_only
            else [(lse, False, 1.0, None) for lse in (True, False)] + [(True, True, 0.0, None)]
        )
        if args.sweep and (bs, ctx) == sweeps["score_shape"]:
            runs += [(True, False, 1.0, c) for c in sweeps["scores"]]
        for lse_given, per_head, decay, cfg in runs:
            score = torch.zeros((state["k"].shape[0], args.kv_heads) if per_head else state["k"].shape[0],
                                dtype=torch.float32, device=device)  # fmt: skip
            bn, nw, ns = cfg or (None, None, None)

            def fn(lse_given=lse_given, decay=decay, score=score, bn=bn, nw=nw, ns=ns):
                attn_scores_(state["q"], state["k"], state["indptr"], state["idx"], score, sm_scale,
                             lse=state["lse"] if lse_given else None, decay=decay, impl="triton",
                             block_n=bn, num_warps=nw, num_stages=ns)  # fmt: skip

            rec = dict(what, impl="triton", lse_given=lse_given, per_head=per_head, decay=decay, block_n=bn,
                       num_warps=nw, num_stages=ns, sweep=cfg is not None, k_bytes=state["k_bytes"],
                       floor_us=state["floor_us"], copy_gbps=copy["gbps"])  # fmt: skip
            measure(
                rec, lambda fn=fn, full=cfg is None: _timings(timers, fn, state["floor_us"], full)
            )
        state.clear()


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
