"""Benchmark the sgl-vtoken kernels against the device's copy bandwidth; one JSON line each.

    python -m sgl_vtoken_tools kernels --out b.jsonl        # GPU: Llama-3.1-8B pool / heads, bf16
    python -m sgl_vtoken_tools kernels --sweep              # + launch-parameter sweeps
    python -m sgl_vtoken_tools kernels --cpu-smoke          # CPU, Triton interpreter, tiny shapes
    python -m sgl_vtoken_tools kernels --summarize b.jsonl  # compact tables of a run

Parts: `host` (per-call Python cost of repack_kv_ outside Triton's launch), `repack` (per move
count and pattern: do_bench time as % of a same-size copy, back-to-back API wall time, host
enqueue time, CUDA-graph device time), `page_indices`, `scores` (attn_scores_ per batch x
context, with and without the LSE, as % of its K read floor). Timers and floors are defined in
`tools/sgl_vtoken_tools/kernel_bench.py`. Each measurement is independent: a failure is recorded as
an `error` line and the run goes on; past `--deadline-s` the rest is recorded as skipped. Needs
torch and triton only (no SGLang).
"""

from __future__ import annotations

import json
import os
import sys
import time

from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import numbers, read_lines

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def parse_args(argv=None):
    p = common.parser(__doc__, __name__)
    numbers(p, layers=32, kv_heads=8, q_heads=32, head_dim=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", default="256,1024,4096,16384,65536", help="repack move counts")
    p.add_argument("--patterns", default="compaction,scatter")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--score-shapes",
        default="8x2048,8x4096,64x2048,64x4096,256x2048,256x4096",
        help="BSxCTX,...",
    )
    p.add_argument("--parts", default="host,repack,page_indices,scores", help="run in this order")
    p.add_argument("--sweep", action="store_true", help="sweep repack and score launch parameters")
    p.add_argument(
        "--sweep-only", action="store_true", help="only the sweeps (and the copies they need)"
    )
    p.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1"
    )
    p.add_argument(
        "--deadline-s", type=float, default=float("inf"), help="skip what would start later"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="-", help="JSONL path ('-' = stdout)")
    p.add_argument("--summarize", metavar="JSONL", help="only print the tables of an earlier run")
    args = p.parse_args(argv)
    args.host_shape = (
        args.layers,
        args.kv_heads,
        args.head_dim,
    )  # host cost: full shapes even on CPU
    if args.cpu_smoke:
        args.layers, args.kv_heads, args.q_heads, args.head_dim = 2, 2, 4, 64
        if args.tokens == p.get_default("tokens"):
            args.tokens = "64,256"
        if args.score_shapes == p.get_default("score_shapes"):
            args.score_shapes = "2x64,3x96"
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.patterns = args.patterns.split(",")
    args.score_shapes = [tuple(int(x) for x in s.split("x")) for s in args.score_shapes.split(",")]
    args.parts = args.parts.split(",")
    args.sweep = args.sweep or args.sweep_only
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(read_lines(args.summarize)))
        return 0
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels (and their @triton.jit) load
    import torch

    from sgl_vtoken_tools import kernel_bench as bench
    from sgl_vtoken_tools import kernel_bench_runs as bench_runs

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the interpreter smoke run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    timers = bench.Timers(device, budget_ms=5.0 if args.cpu_smoke else 50.0)
    out = sys.stdout if args.out == "-" else open(args.out, "a")
    deadline = time.monotonic() + args.deadline_s
    common = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        mode="cpu-smoke" if args.cpu_smoke else "gpu", torch=torch.__version__, triton=_triton_version(),
    )  # fmt: skip
    failures = 0

    def emit(**rec):
        out.write(json.dumps({**common, **rec}) + "\n")
        out.flush()

    def measure(what: dict, fn):
        """Run one measurement; record its result, its error, or that the deadline passed."""
        nonlocal failures
        if time.monotonic() > deadline:
            return emit(**what, skipped="deadline")
        try:
            emit(**what, **fn())
        except Exception as e:  # noqa: BLE001 (one failure must not end the run)
            failures += not what.get("sweep")  # a sweep point may exceed the device's resources
            emit(**what, error=f"{type(e).__name__}: {e}"[:500])
        if device.type == "cuda":
            torch.cuda.empty_cache()

    dtype = getattr(torch, DTYPES[args.dtype])
    g = torch.Generator().manual_seed(args.seed)

    def host_part():
        layers, heads, dim = args.host_shape
        measure(dict(kernel="repack_kv", part="host_overhead", layers=layers, kv_heads=heads, head_dim=dim, dtype=args.dtype),
                lambda: bench.repack_host_overhead(layers, heads, dim, dtype, device))  # fmt: skip

    parts = dict(
        host=host_part,
        repack=lambda: bench_runs.repack_part(args, timers, dtype, g, measure),
        page_indices=lambda: bench_runs.page_index_part(args, timers, g, measure),
        scores=lambda: bench_runs.score_part(args, timers, dtype, g, measure),
    )
    for name in args.parts:
        if name not in parts:
            emit(part=name, kernel=None, error=f"unknown part; choose from {sorted(parts)}")
            failures += 1
            continue
        parts[name]()
    if out is not sys.stdout:
        out.close()
    return 1 if failures else 0


def summarize(rows: list[dict]) -> str:
    """Compact tables of a run: host overhead, repacker vs copy, scores vs their read floor."""
    lines, pct = [], lambda x: "   -  " if x is None else f"{100 * x:5.1f}%"  # noqa: E731
    num = lambda x, w=7: " " * (w - 1) + "-" if x is None else f"{x:{w}.1f}"  # noqa: E731
    if rows:
        r0 = rows[0]
        lines.append(
            f"{r0.get('device')}  torch {r0.get('torch')}  triton {r0.get('triton')}  ({r0.get('mode')})"
        )
    for r in rows:
        if r.get("part") == "host_overhead" and "cached_us" in r:
            lines.append(f"repack_kv_ host cost outside Triton's launch ({r['buffers']} buffers): "
                         f"{r['cached_us']:.1f} us per call (validated set cached), {r['first_call_us']:.0f} us first call")  # fmt: skip
    lines.append(
        "repack_kv (triton, default launch) vs a same-size d2d copy; targets >= 50% at 1024 moves, >= 85% from 16384:"
    )
    lines.append(
        "  pattern     moves   do_bench us  %copy   API wall us  host us  graph us  %copy(graph)"
    )
    for r in rows:
        if (
            r.get("kernel") == "repack_kv"
            and r.get("impl") == "triton"
            and not r.get("sweep")
            and "time_us" in r
        ):
            lines.append(f"  {r['pattern']:<10} {r['tokens']:>6}  {num(r['time_us'], 11)}  {pct(r['frac_of_copy'])}  "
                         f"{num(r.get('api_wall_us'), 11)}  {num(r.get('host_us'))}  {num(r.get('graph_us'), 8)}  "
                         f"{pct(r.get('graph_frac_of_copy'))}")  # fmt: skip
    torch_rows = [
        r
        for r in rows
        if r.get("kernel") == "repack_kv" and r.get("impl") == "torch" and "time_us" in r
    ]
    if torch_rows:
        lines.append("  torch gather/scatter: " + ", ".join(
            f"{r['pattern'][:4]} {r['tokens']}: {pct(r['frac_of_copy']).strip()}" for r in torch_rows))  # fmt: skip
    _best(
        lines,
        rows,
        "repack_kv",
        ("block_moves", "num_warps", "col_block"),
        "frac_of_copy",
        ("tokens",),
    )
    lines.append(
        "attn_scores_ (triton) vs its K read floor (K bytes at large-copy bandwidth); target >= 80%:"
    )
    lines.append(
        "  bs x ctx     lse    mode         floor us  do_bench us  %floor  API wall us  graph us  %floor(graph)"
    )
    for r in rows:
        if r.get("kernel") == "attn_scores" and not r.get("sweep") and "time_us" in r:
            mode = ("per-head" if r["per_head"] else "summed") + f" d={r['decay']:g}"
            lines.append(f"  {r['bs']:>3} x {r['ctx']:<5}  {'given' if r['lse_given'] else 'none ':<5}  {mode:<12} "
                         f"{num(r['floor_us'], 8)}  {num(r['time_us'], 11)}  {pct(r['frac_of_floor'])}  "
                         f"{num(r.get('api_wall_us'), 11)}  {num(r.get('graph_us'), 8)}  {pct(r.get('graph_frac_of_floor'))}")  # fmt: skip
    _best(
        lines,
        rows,
        "attn_scores",
        ("block_n", "num_warps", "num_stages"),
        "frac_of_floor",
        ("bs", "ctx"),
    )
    for r in rows:
        if r.get("kernel") == "page_indices" and "time_us" in r:
            lines.append(
                f"page_indices {r['impl']:<6} bs {r['bs']}, {r['pages']} pages: {r['time_us']:.1f} us"
            )
    bad = [r for r in rows if "error" in r or "skipped" in r]
    lines.append(f"{len(rows)} measurements, {sum('error' in r for r in bad)} errors, "
                 f"{sum('skipped' in r for r in bad)} skipped (deadline)")  # fmt: skip
    for r in bad[:10]:
        keys = (
            "kernel",
            "impl",
            "pattern",
            "tokens",
            "bs",
            "ctx",
            "block_moves",
            "block_n",
            "num_warps",
        )
        lines.append(
            f"  {r.get('error') or 'skipped'}  [{', '.join(f'{k}={r[k]}' for k in keys if r.get(k) is not None)}]"
        )
    return "\n".join(lines)


def _best(lines, rows, kernel, knobs, metric, by) -> None:
    swept = [r for r in rows if r.get("kernel") == kernel and r.get("sweep") and metric in r]
    for key in sorted({tuple(r[k] for k in by) for r in swept}):
        group = sorted(
            (r for r in swept if tuple(r[k] for k in by) == key), key=lambda r: -r[metric]
        )
        top = ", ".join(f"{tuple(r[k] for k in knobs)} {100 * r[metric]:.1f}%" for r in group[:3])
        lines.append(f"  sweep {dict(zip(by, key))} best {knobs}: {top}")


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None
