"""Decode scoring captured in a CUDA graph, against the eager scoring, at 8B shapes (no SGLang).

    python -m sgl_vtoken_tools graph-scores                  # CUDA: batch 1/8/64/256, 8B, bf16
    python -m sgl_vtoken_tools graph-scores --device cpu     # CPU dry run: tiny shapes, no capture

Per batch size, one `GraphScoring` (rows bounded by budget + interval + page_size) is captured in
a `torch.cuda.CUDAGraph` (every layer's score launch, on static query buffers); then random
batches (scored rows of random lengths up to the bound, some lanes not scored, padding lanes)
are replayed (load, replay, unload) and compared with the eager `DecodeScoring` of the same
batch, and both are timed. One JSON line per batch size: eager and graph medians (ms, the host
work included, synchronized at the end), replay alone, the largest difference, the buffers'
bytes. On CPU the capture is stubbed (the captured calls run again): the check, not the speed.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from sgl_vtoken.decode_scores import DecodeScoring
from sgl_vtoken.graph_scores import GraphScoring
from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.cli import common

SHAPES = {"llama8b": (32, 32, 8, 128), "tiny": (2, 4, 2, 16)}  # layers, q heads, KV heads, dim
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = common.parser(__doc__, __name__)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama8b" if cuda else "tiny")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--batches", default="1,8,64,256" if cuda else "1,4")
    p.add_argument("--bound", type=int, default=288 if cuda else 24, help="budget+interval+page")
    p.add_argument("--pool", type=int, default=65536 if cuda else 512, help="pool slots")
    p.add_argument("--repeats", type=int, default=20 if cuda else 2)
    p.add_argument("--out", default="-", help="JSONL path ('-' = stdout only)")
    return p.parse_args(argv)


class Captured:
    """Every layer's score launch of one batch size, in a CUDA graph (on CPU: the calls kept
    and run again)."""

    def __init__(self, gs: GraphScoring, bs: int, q, k, scale: float, device: str):
        self.gs, self.bs, self.q, self.k, self.scale = gs, bs, q, k, scale
        self.graph = None
        gs.capture(bs)
        self._launch()  # warm-up: compiles the kernel outside the capture
        if device == "cuda":
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._launch()

    def _launch(self):
        for layer, (q, k) in enumerate(zip(self.q, self.k)):
            self.gs.score(layer, q, k, self.scale)

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.gs.bs = self.bs
            self._launch()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_batch(args, bs: int, rng: random.Random) -> dict:
    layers, hq, hkv, dim = SHAPES[args.shape]
    dev, dtype = args.device, DTYPES[args.dtype]
    gen = torch.Generator(device=dev).manual_seed(bs)
    k = [
        torch.randn(args.pool, hkv, dim, device=dev, dtype=dtype, generator=gen)
        for _ in range(layers)
    ]
    q = [torch.zeros(bs, hq, dim, device=dev, dtype=dtype) for _ in range(layers)]
    rows = torch.randint(0, args.pool, (bs, args.bound), device=dev, generator=gen)
    gs = GraphScoring(bs, args.bound, layers, hkv, dev)
    scale = dim**-0.5
    captured = Captured(gs, bs, q, k, scale, dev)
    eager_ms, graph_ms, replay_ms, diff = [], [], [], 0.0
    for _ in range(args.repeats):
        lanes = [b for b in range(bs) if bs == 1 or rng.random() < 0.9]
        lengths = [rng.randint(1, args.bound) for _ in lanes]
        for x in q:
            x.copy_(torch.randn(bs, hq, dim, device=dev, dtype=dtype, generator=gen))
        plan = (lanes, lanes, lengths, [None] * len(lanes), layers, hkv, dev)
        _sync(dev)
        t0 = time.perf_counter()
        eager = DecodeScoring(*plan)
        for layer in range(layers):
            eager.score(layer, q[layer], k[layer], rows, scale)
        _sync(dev)
        t1 = time.perf_counter()
        replayed = DecodeScoring(*plan)
        gs.load(replayed, bs, rows)
        _sync(dev)
        t2 = time.perf_counter()
        captured.replay()
        _sync(dev)
        t3 = time.perf_counter()
        gs.unload(replayed)
        _sync(dev)
        t4 = time.perf_counter()
        eager_ms.append((t1 - t0) * 1e3)
        graph_ms.append((t4 - t1) * 1e3)
        replay_ms.append((t3 - t2) * 1e3)
        diff = max(diff, float((replayed.buf - eager.buf).abs().max()) if lanes else 0.0)
    med = statistics.median
    return dict(
        bench="graph_scores", device=dev, shape=args.shape, dtype=args.dtype, batch=bs,
        bound=args.bound, pool=args.pool, repeats=args.repeats, captured=captured.graph is not None,
        eager_ms=round(med(eager_ms), 4), graph_ms=round(med(graph_ms), 4),
        replay_ms=round(med(replay_ms), 4),
        speedup=round(med(eager_ms) / max(med(graph_ms), 1e-9), 3),
        max_abs_diff=diff, equal=diff <= 1e-3, buffer_bytes=gs.nbytes(),
    )  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(0)
    log = RunLog(None if args.out == "-" else args.out, append=True, echo=True)
    status = 0
    for bs in (int(b) for b in args.batches.split(",")):
        try:
            line = run_batch(args, bs, rng)
            status |= 0 if line["equal"] else 1
        except Exception as e:  # a failing batch is recorded and the next one runs
            line, status = dict(bench="graph_scores", batch=bs, error=repr(e)), 1
        log.emit(line)
    log.close()
    return status
