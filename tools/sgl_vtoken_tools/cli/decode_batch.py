"""How one decode step's cost grows with the batch, on stock SGLang: the ceiling on what running
more requests at once can buy on this machine.

    python -m sgl_vtoken_tools decode-batch --out docs/results/decode_batch_smollm2.jsonl

One server (stock SGLang, no plugin; `--plugin` for the plugin with `--kv-evict none`) on a pool
large enough that every batch runs whole. For each batch size B, B greedy `/generate` requests of
`--prompt-tokens` random ids and `--new-tokens` output tokens are sent at once; SGLang's decode
records ("Decode batch, #running-req: B, ... gen throughput (token/s): X", one per step with
`--decode-log-interval 1`) give the step time at exactly B running, ``1000 * B / X`` ms. One JSON
line per (B, repeat) and one `scaling` line: step time and throughput against B = 1. If the step
time grows nearly as fast as B, concurrency buys little throughput here, whatever frees memory.

`--prefill-lengths L ...` also times prompts of L random ids sent alone with one output token
(the prefill and one sample), `--repeats` each: a `prefill` line per length with the median
seconds and prompt tokens per second. A workload's prompt tokens divided by that rate is the
time no eviction setting saves (eviction frees KV after a prompt is computed, not the compute).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.cli import common


def batch_line(records: list[tuple[int, float]], batch: int) -> dict:
    """The decode records taken at exactly `batch` running: their median throughput, step time."""
    rates = [x for n, x in records if n == batch and x > 0]
    if not rates:
        return {"batch": batch, "records": 0, "decode_tok_s": None, "step_ms": None}
    tput = statistics.median(rates)
    return {
        "batch": batch,
        "records": len(rates),
        "decode_tok_s": round(tput, 2),
        "step_ms": round(1000 * batch / tput, 2),
        "per_request_tok_s": round(tput / batch, 3),
    }


def scaling(lines: list[dict]) -> dict:
    """Per batch size, the median step time and throughput over repeats, relative to B = 1."""
    by_b: dict[int, list[dict]] = {}
    for r in lines:
        if r.get("step_ms") is not None:
            by_b.setdefault(r["batch"], []).append(r)
    med = {
        b: (
            statistics.median(r["step_ms"] for r in rs),
            statistics.median(r["decode_tok_s"] for r in rs),
        )
        for b, rs in sorted(by_b.items())
    }
    base = med.get(1)
    return {
        "kind": "scaling",
        "batches": [
            {
                "batch": b,
                "step_ms": round(s, 2),
                "decode_tok_s": round(t, 2),
                **(
                    {"step_vs_b1": round(s / base[0], 2), "throughput_vs_b1": round(t / base[1], 2)}
                    if base
                    else {}
                ),
            }
            for b, (s, t) in med.items()
        ],
    }


def prefill_line(length: int, seconds: list[float]) -> dict:
    """The median of a prompt length's timings, in seconds and prompt tokens per second."""
    med = statistics.median(seconds)
    return {
        "kind": "prefill",
        "prompt_tokens": length,
        "runs": len(seconds),
        "seconds": round(med, 3),
        "prefill_tok_s": round(length / med, 1),
    }


def run(args) -> list[dict]:
    from sgl_vtoken_tools.bench import probe, server_log
    from sgl_vtoken_tools.bench.cell_server import launch, resolve_model
    from sgl_vtoken_tools.bench.http_client import generate

    batch = max(args.batches) * (args.prompt_tokens + args.new_tokens)
    need = max([batch] + [n + 1 for n in args.prefill_lengths])
    if need > args.pool:
        raise SystemExit(
            f"--pool {args.pool} is below the {need} tokens of the largest batch or prompt: "
            "it would queue"
        )
    model = resolve_model(args.model)
    rng = random.Random(args.seed)
    log = RunLog(args.out, echo=True)
    lines, emit = log.records, log.emit

    with launch(
        model,
        "plugin" if args.plugin else "stock",
        ["--kv-evict", "none"] if args.plugin else None,
        args.pool,
        server_args=["--max-running-requests", str(max(args.batches))],
        threads=args.server_threads,
    ) as server:
        emit(
            {
                "kind": "config",
                "model": model,
                "pool": args.pool,
                "plugin": args.plugin,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "server_threads": args.server_threads,
                "batches": args.batches,
                "repeats": args.repeats,
            }
        )
        for rep in range(args.repeats):
            for b in args.batches:
                probe.flush_cache(server.base_url)
                prompts = [
                    [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)] for _ in range(b)
                ]
                start = server.log_path.stat().st_size
                t0 = time.perf_counter()
                with ThreadPoolExecutor(b) as ex:
                    list(
                        ex.map(
                            lambda ip: generate(
                                server.base_url,
                                ip[1],
                                args.new_tokens,
                                1800,
                                rid=f"db-r{rep}-b{b}-{ip[0]}",
                            ),
                            enumerate(prompts),
                        )
                    )
                wall = time.perf_counter() - t0
                records = server_log.decode_throughput(server_log.read_from(server.log_path, start))
                emit(
                    {
                        "kind": "batch",
                        "repeat": rep,
                        "wall_s": round(wall, 2),
                        **batch_line(records, b),
                    }
                )
        for n in args.prefill_lengths:
            seconds = []
            for rep in range(args.repeats):
                probe.flush_cache(server.base_url)
                t0 = time.perf_counter()
                generate(
                    server.base_url,
                    [rng.randrange(100, 20000) for _ in range(n)],
                    1,
                    1800,
                    rid=f"pf-r{rep}-{n}",
                )
                seconds.append(time.perf_counter() - t0)
            emit(prefill_line(n, seconds))
    emit(scaling([r for r in lines if r["kind"] == "batch"]))
    log.close()
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, __name__)
    common.model_flag(p, help="Hugging Face folder, or smollm2 (built into .cache)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    common.numbers(p, prompt_tokens=256, new_tokens=32)
    p.add_argument(
        "--prefill-lengths",
        type=int,
        nargs="*",
        default=[],
        help="also time prompts of these lengths alone (one output token): prefill tokens/s",
    )
    common.server_flags(
        p,
        8192,
        "--max-total-tokens (every batch must fit)",
        page_size=False,
        threads_help="OMP_NUM_THREADS of the server",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--plugin",
        action="store_true",
        help="the plugin loaded with --kv-evict none (default: stock)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON lines file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.batches) < 1 or args.repeats < 1 or min(args.prefill_lengths, default=1) < 1:
        raise SystemExit("--batches, --prefill-lengths and --repeats must be >= 1")
    run(args)
    return 0
