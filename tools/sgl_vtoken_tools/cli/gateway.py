"""SGLang's multi-turn chat benchmark through SGLang's model gateway (smg) to evicting replicas,
per routing policy, against one replica alone (CPU; needs the `scale` extra).

    python -m sgl_vtoken_tools gateway --repeats 3 --out docs/results/gateway.jsonl

Starts `--replicas` servers of one configuration (`--kv-evict streamingllm --kv-budget B
--kv-evict-interval P`, page size P, no overlap scheduler, as in the `multiturn` command), then
per repeat plays the same bench_serving dataset once per route: straight to the first replica,
then through `smg launch --policy P` for each of `--policies`, every replica's cache flushed
first. The default workload weighs the conversations' own turns (system prompt 128 tokens,
questions 256, replies 64, 4 turns) over the shared system prompt, and the default pool (16K
tokens a replica) holds every stored history, so what a route loses is what its routing loses.
JSON lines: one per (route, repeat), see `sgl_vtoken_tools.bench.gateway`; a markdown table goes
to stderr.
"""

from __future__ import annotations

import sys

from sgl_vtoken_tools.bench.cell_server import resolve_model
from sgl_vtoken_tools.bench.gateway import routes, run_route, start_replicas
from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.bench.quantiles import median_text
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.launcher import evict_args


def table(lines: list[dict]) -> str:
    """Per route the median over repeats (range in brackets when repeats differ)."""
    out = [
        "| route | history hit rate (%) | prompt tokens | cached tokens | prefilled tokens | "
        "requests per replica | completed | mean TTFT (ms) |",
        "|---" * 8 + "|",
    ]
    for label in dict.fromkeys(line["route"] for line in lines):
        rs = [r for r in lines if r["route"] == label]

        def med(key, digits=0, scale=1.0, rs=rs):
            return median_text([r[key] for r in rs], digits, scale)

        per = " / ".join(
            median_text([r["per_replica"][i]["requests"] for r in rs], 0)
            for i in range(rs[0]["replicas"])
        )
        out.append(
            f"| {label} | {med('hit_rate', 1, 100)} | {med('prompt')} | {med('cached')} | "
            f"{med('prefilled')} | {per} | {med('completed')} | {med('mean_ttft_ms')} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __name__)
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--policies", default="cache_aware,round_robin,manual", help="smg --policy values"
    )
    p.add_argument("--smg-flags", default="", help="more smg flags for every gateway (one string)")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pool", type=int, default=16384, help="--max-total-tokens of every replica")
    common.numbers(p, page_size=16, repeats=1)
    common.workload_flags(p, prompts_per_group=4, system_len=128, output_len=64)
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args(argv)
    model = args.model or resolve_model("tiny")
    work = common.workload(args)
    flags = (*evict_args("streamingllm", args.budget, args.page_size), "--disable-overlap-schedule")
    plan = routes(args.policies.split(","), tuple(args.smg_flags.split()))
    replicas = start_replicas(model, args.replicas, args.pool, args.page_size, flags)
    log = RunLog(args.out, append=True, echo=True)
    lines = log.records
    try:
        for repeat in range(args.repeats):
            for route in plan:
                print(f"[gateway] repeat {repeat}: {route.label}", file=sys.stderr)
                line = {
                    "repeat": repeat,
                    "pool": args.pool,
                    "page": args.page_size,
                    "server_flags": list(flags),
                    **run_route(route, replicas, model, work),
                }
                log.emit(line)
    finally:
        for s in replicas:
            s.stop()
    print(table(lines), file=sys.stderr)
    return 0
