"""Speed and answers in one benchmark: stock SGLang, the full cache and eviction settings on the
same concurrent chat conversations whose answers are known, side by side in one run.

    python -m sgl_vtoken_tools joint --out docs/results/joint_smollm2.jsonl --markdown joint.md \\
        --plot docs/img/joint_smollm2.png                       # SmolLM2, held-out split, 3 repeats
    python -m sgl_vtoken_tools joint --report docs/results/joint_smollm2.jsonl   # tables again

Every cell starts one CPU server on the same pool (`--pool`, small enough that stock SGLang runs
only a few conversations at once) and plays the same conversations
(`tools/sgl_vtoken_tools/bench/joint.py`: the split's sessions and document questions, all sent
at once, the same request ids) `--repeats` times, the tree flushed between repeats. Every server
runs without the overlap scheduler (eviction during prefill needs that), so cells differ in their
eviction flags alone. Cells (`--cells`, `name=flags` for others):

    stock      SGLang without sgl-vtoken (SGLANG_PLUGINS lists every other plugin; a
               sitecustomize shim applies only the CPU RoPE fix the plugin carries)
    full       the plugin loaded, `--kv-evict none`: the full cache
    others     the plugin with their eviction flags (`tools/sgl_vtoken_tools/bench/server_cells.py`)

One JSON line per request (`request`), per conversation (`answer`) and per (cell, repeat)
(`summary`: output tokens/s, prompt tokens computed, later turns continued from a device or a
host history, from SGLang's radix prefix or prefilled again, host bytes moved per turn (the
plugin's host counters over the repeat), mean TTFT, accuracy, agreement with the full cache's answers of the same repeat,
device KV per conversation, retractions, peak running), then one `cell` line per cell (the
spread over repeats, throughput and prompt tokens computed as ratios to stock's) and the
markdown table (`tools/sgl_vtoken_tools/bench/joint_table.py`). The README's chat command (host
histories, offload, recall 192) against stock:

    python -m sgl_vtoken_tools joint --cells stock "h2o b256 s16 w32 + host + recall 192" \
        --out docs/results/joint_smollm2_host.jsonl --markdown docs/results/joint_smollm2_host.md
"""

from __future__ import annotations

import argparse

from sgl_vtoken_tools.bench.cell_server import resolve_model
from sgl_vtoken_tools.bench.joint_table import plot, spread_lines, table
from sgl_vtoken_tools.bench.server_cells import CELLS
from sgl_vtoken_tools.bench.server_cells import cell_flags as server_cell
from sgl_vtoken_tools.cli import common


def cell_flags(spec: str) -> tuple[str, list[str] | None]:
    """A `--cells` entry: a name of CELLS, or ``name=flags`` (shell words)."""
    try:
        return server_cell(spec)
    except ValueError as e:
        raise SystemExit(f"--cells: {e}") from None


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.bench.joint import (
        JointSpec,
        Send,
        conversations,
        play,
        summarize,
    )

    model = resolve_model(args.model)
    spec = common.from_args(JointSpec, args)
    convs = conversations(AutoTokenizer.from_pretrained(model), spec, args.wheel_dir)
    cells = common.cells_in_order(args, CELLS, "full")  # agreement needs its answers first
    run = common.run_log(args, model, cells, False, spec=vars(spec), conversations=len(convs))
    common.play_repeats(
        args,
        model,
        cells,
        run.emit,
        lambda url, model_id, _, rep: play(
            url,
            model_id,
            convs,
            Send(rid_prefix=f"joint-r{rep}", max_tokens=spec.reply_tokens),
            concurrency=args.concurrency,
        ),
        summarize,
        lambda s: (
            f"{s['output_tokens_per_s']} tok/s, accuracy {s['accuracy']}, "
            f"computed {s['prefill_tokens']}, later turns device/host/prefix/again "
            f"{s['turns_from_device']}/{s['turns_from_host']}/"
            f"{s['turns_from_prefix']}/{s['turns_prefilled_again']}, "
            f"host B/turn {s['host_bytes_per_turn']}, "
            f"retractions {s['retractions']}, failed {s['failed']}"
        ),
    )
    return common.close_run(run, spread_lines)


def build_parser() -> argparse.ArgumentParser:
    p = common.play_parser(
        __doc__,
        __name__,
        CELLS,
        2560,
        "--max-total-tokens of every server: small enough that stock queues, at least the "
        "longest conversation (about 2,200 tokens at the default sizes)",
        remote=False,
        cells_help="cell names or name=flags (default: every cell of CELLS)",
        model_help="Hugging Face folder, or smollm2 (built into .cache)",
    )
    p.add_argument(
        "--concurrency", type=int, default=0, help="conversations in flight (0: all at once)"
    )
    common.numbers(p, sessions=12, turns=4, passage_tokens=200, docqa=12)
    p.add_argument("--docqa-lengths", type=int, nargs="+", default=[1000, 2000])
    p.add_argument(
        "--reply-tokens",
        type=int,
        default=128,
        help="max_tokens of every turn (greedy, stops at EOS)",
    )
    common.split_flags(p)
    common.output_flags(
        p,
        plot_help="accuracy vs throughput ratio, one point per cell",
        report_help="only render the table (and --plot) of a run's lines",
    )
    return p


def check(parser, args) -> None:
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1 (got {args.repeats})")
    for c in args.cells:
        cell_flags(c)  # unknown names fail before any server starts


def main(argv: list[str] | None = None) -> int:
    return common.report_or_run(build_parser(), argv, check, table, run, spread_lines, plot)
