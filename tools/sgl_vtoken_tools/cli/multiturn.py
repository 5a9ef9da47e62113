"""SGLang's multi-turn chat benchmark (`sglang.bench_serving`, generated-shared-prefix, chat
backend) against stock SGLang and `--kv-evict streamingllm`, side by side in one run (CPU).

    python -m sgl_vtoken_tools multiturn --out docs/results/multiturn.jsonl --results-md docs/results/sglang-multiturn.md

Cells: stock, streamingllm (budget below the system prompt; interval 1 at page size 1, 16 at
page size 16) and streamingllm with eviction during prefill (`prefill_chunk`) at each page size,
on one fixed pool, every cell the same dataset, none with the overlap scheduler. Each repeat runs
every cell once, in order. JSON lines: one per (cell, repeat), see `sgl_vtoken_tools.bench.multiturn`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sgl_vtoken_tools.bench.cell_server import resolve_model
from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.bench.multiturn import cells, run_cell
from sgl_vtoken_tools.bench.quantiles import median_text
from sgl_vtoken_tools.bench.results_md import write_section
from sgl_vtoken_tools.cli import common


def table(lines: list[dict], args) -> str:
    """Markdown: per cell the median over repeats (range in brackets when repeats differ)."""
    w = lines[0]["workload"]
    out = [
        f"`python -m sglang.bench_serving --backend sglang-oai-chat --dataset-name generated-shared-prefix` "
        f"({w['groups']} groups x {w['prompts_per_group']} conversations, {w['turns']} turns, system prompt "
        f"{w['system_len']}, questions {w['question_len']}, replies {w['output_len']} tokens, all sent at once), "
        f"tiny model on CPU, pool {lines[0]['pool']} tokens, no overlap scheduler, {args.repeats} repeat(s); "
        f"`python -m sgl_vtoken_tools multiturn`. Raw lines: `{args.out}`.",
        "",
        "| server | output tok/s | mean TTFT (ms) | mean TPOT (ms) | completed | prefilled tokens | "
        "cached tokens | peak running | retractions |",
        "|---" * 9 + "|",
    ]
    for label in dict.fromkeys(line["cell"] for line in lines):
        rs = [line for line in lines if line["cell"] == label]

        def fmt(key, digits=0, rs=rs):
            return median_text([r[key] for r in rs], digits)

        out.append(
            f"| {label} | {fmt('output_throughput', 1)} | {fmt('mean_ttft_ms')} | {fmt('mean_tpot_ms', 1)} | "
            f"{fmt('completed')} | {fmt('prefilled_tokens')} | {fmt('cached_tokens')} | "
            f"{fmt('peak_running')} | {fmt('retractions')} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __name__)
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--pool", type=int, default=4096, help="--max-total-tokens of every server")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prefill_chunk of the cells that evict during prefill (0: no such cells)",
    )
    p.add_argument("--repeats", type=int, default=1)
    common.workload_flags(p, prompts_per_group=8, system_len=512, output_len=128)
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    p.add_argument("--results-md", type=Path, default=None, help="rewrite its multiturn section")
    args = p.parse_args(argv)
    model = args.model or resolve_model("tiny")
    work = common.workload(args)
    log = RunLog(args.out, append=True, echo=True)
    lines = log.records
    for repeat in range(args.repeats):
        for cell in cells(
            args.budget,
            tuple(int(x) for x in args.page_sizes.split(",")),
            args.prefill_chunk or None,
        ):
            print(f"[multiturn] repeat {repeat}: {cell.label}", file=sys.stderr)
            line = {"repeat": repeat, **run_cell(cell, model, model, work, args.pool)}
            log.emit(line)
    print(table(lines, args), file=sys.stderr)
    if args.results_md:
        write_section(args.results_md, "multiturn", table(lines, args))
    return 0
