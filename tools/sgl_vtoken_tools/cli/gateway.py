#!/usr/bin/env python
"""SGLang's multi-turn chat benchmark through SGLang's model gateway (smg) to evicting replicas,
per routing policy, against one replica alone (CPU; needs the `scale` extra).

    python scripts/bench_gateway.py --repeats 3 --out docs/results/gateway.jsonl

Starts `--replicas` servers of one configuration (`--kv-evict streamingllm --kv-budget B
--kv-evict-interval P`, page size P, no overlap scheduler, as in scripts/bench_multiturn.py), then
per repeat plays the same bench_serving dataset once per route: straight to the first replica,
then through `smg launch --policy P` for each of `--policies`, every replica's cache flushed
first. The default workload weighs the conversations' own turns (system prompt 128 tokens,
questions 256, replies 64, 4 turns) over the shared system prompt, and the default pool (16K
tokens a replica) holds every stored history, so what a route loses is what its routing loses.
JSON lines: one per (route, repeat), see `sgl_vtoken_tools.bench.gateway`; a markdown table goes
to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from sgl_vtoken_tools.bench.gateway import routes, run_route, start_replicas
from sgl_vtoken_tools.bench.multiturn import Workload
from sgl_vtoken_tools.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent


def spread(values, digits=0, scale=1.0) -> str:
    vals = [v * scale for v in values]
    med = f"{statistics.median(vals):.{digits}f}"
    return med if len(vals) == 1 else f"{med} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def table(lines: list[dict]) -> str:
    """Per route the median over repeats (range in brackets when repeated)."""
    out = [
        "| route | history hit rate (%) | prompt tokens | cached tokens | prefilled tokens | "
        "requests per replica | completed | mean TTFT (ms) |",
        "|---" * 8 + "|",
    ]
    for label in dict.fromkeys(line["route"] for line in lines):
        rs = [r for r in lines if r["route"] == label]
        per = " / ".join(
            spread([r["per_replica"][i]["requests"] for r in rs]) for i in range(rs[0]["replicas"])
        )
        out.append(
            f"| {label} | {spread([r['hit_rate'] for r in rs], 1, 100)} | "
            f"{spread([r['prompt'] for r in rs])} | {spread([r['cached'] for r in rs])} | "
            f"{spread([r['prefilled'] for r in rs])} | {per} | {spread([r['completed'] for r in rs])} | "
            f"{spread([r['mean_ttft_ms'] for r in rs])} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--policies", default="cache_aware,round_robin,manual", help="smg --policy values"
    )
    p.add_argument("--smg-flags", default="", help="more smg flags for every gateway (one string)")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pool", type=int, default=16384, help="--max-total-tokens of every replica")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts-per-group", type=int, default=4)
    p.add_argument("--system-len", type=int, default=128)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args()
    model = args.model or str(ensure_tiny_model(REPO / ".cache" / "tiny-llama"))
    work = Workload(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        args.turns,
    )
    flags = (
        "--kv-evict",
        "streamingllm",
        "--kv-budget",
        str(args.budget),
        "--kv-evict-interval",
        str(args.page_size),
        "--disable-overlap-schedule",
    )
    plan = routes(args.policies.split(","), tuple(args.smg_flags.split()))
    replicas = start_replicas(model, args.replicas, args.pool, args.page_size, flags)
    lines = []
    try:
        for repeat in range(args.repeats):
            for route in plan:
                print(f"[bench_gateway] repeat {repeat}: {route.label}", file=sys.stderr)
                line = {
                    "repeat": repeat,
                    "pool": args.pool,
                    "page": args.page_size,
                    "server_flags": list(flags),
                    **run_route(route, replicas, model, work),
                }
                lines.append(line)
                print(json.dumps(line), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")
    finally:
        for s in replicas:
            s.stop()
    print(table(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
