"""Multi-turn sessions with and without compacted-history reuse, side by side in one run (CPU, tiny model).

History part: three servers per page size (`--page-sizes`, default 1 and 16; interval 1 at page
size 1, 16 above), one after the other, all `--kv-evict streamingllm --kv-budget B`:
"reuse" (`--radix-cache-backend vtoken`, chosen automatically) continues every turn from the
stored compacted history and prefills only the new tokens; "prompt-cache" (`reuse_history:
false`) caches full-attention prompts only, so a turn prefills the previous reply and its message
over the whole uncompacted previous prompt; "re-prefill" (`--disable-radix-cache`) prefills the
whole history every turn. Every session shares one system prompt (cached by a warm-up request)
and runs `--turns` turns, all sessions' turn k at once; turn k's prompt is turn k-1's prompt + its
reply + a new user message (token ids through `/generate`, streamed: TTFT = first chunk).

Prints JSON lines: one per (page size, mode, turn) with TTFT p50/mean and mean prefilled / cached
/ history tokens, one summary per (page size, mode) with the server counters (peak pool slots held
against the bound `system + sessions x (budget + interval + page + 1)`, history hits). `--plot` writes a PNG of TTFT per turn;
`--results-md` rewrites the `history` and `sharing` sections of
docs/results/prefix-sharing-history.md.

The sharing part (`--part sharing`): the same sessions' first turn at page size 16, all at once,
with the holed radix cache vs no radix cache: peak pool slots held, against the bound
`prompt once + sessions x (budget/page + 2) pages`, retractions, TTFT and throughput.

    python -m sgl_vtoken_tools history                       # 16 sessions x 8 turns, system 2048, budget 512
    python -m sgl_vtoken_tools history --part sharing        # page 16 only
    python -m sgl_vtoken_tools history --quick               # smoke run
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from sgl_vtoken_tools.bench.cell_server import resolve_model
from sgl_vtoken_tools.bench.http_client import stream_generate
from sgl_vtoken_tools.bench.plots import pyplot, save
from sgl_vtoken_tools.bench.probe import vtoken_state
from sgl_vtoken_tools.bench.results_md import write_section
from sgl_vtoken_tools.bench.server_log import count_retractions
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args, evict_args

# mode -> extra server flags: continue from the stored compacted history; cache full-attention
# prompts only (each turn prefills what its cached prompt lacks); no radix cache at all.
MODES = {
    "reuse": ["--kv-evict-config", '{"reuse_history": true}'],
    "prompt-cache": ["--kv-evict-config", '{"reuse_history": false}'],
    "re-prefill": ["--disable-radix-cache"],
}


def interval(page_size: int) -> int:
    """Eviction interval of the history part: every step at page size 1, a page above."""
    return 1 if page_size == 1 else page_size


def bound(args, page_size: int) -> int:
    """Pool slots the sessions can hold after turn 1: the system prompt once, and per session its
    row (budget + interval, rounded up to pages) plus the page its partial last page may take."""
    row = -(-(args.budget + interval(page_size)) // page_size) * page_size
    return args.system_tokens + args.sessions * (row + page_size)


def server_cmd(model: str, pool: int, page_size: int, budget: int, every: int, flags) -> list:
    """A fp32 CPU server evicting with streamingllm at `budget` every `every` steps, cache report
    on, then `flags`."""
    evict = evict_args("streamingllm", budget, every) + ["--enable-cache-report"]
    return cpu_server_args(model, pool, page_size) + ["--dtype", "float32", *evict, *flags]


def run_mode(args, model: str, flags: list[str], page_size: int) -> tuple[list[dict], dict]:
    """All sessions' turn k at once, then turn k + 1 (an agent fleet in lock step)."""
    cmd = server_cmd(model, args.pool, page_size, args.budget, interval(page_size), flags)
    rng = random.Random(args.seed)
    system = [rng.randrange(10, 2000) for _ in range(args.system_tokens)]
    rngs = [random.Random(args.seed * 1000 + i) for i in range(args.sessions)]
    prompts = [system + [r.randrange(10, 2000) for _ in range(args.user_tokens)] for r in rngs]
    records: list[dict] = []
    with ServerProcess(cmd, env={"OMP_NUM_THREADS": "1"}) as server:
        info = lambda: vtoken_state(server.base_url, strict=True)  # noqa: E731
        stream_generate(server.base_url, system + [1], 4, "warm")  # the system prompt is cached
        state = {}
        for turn in range(args.turns):

            def one(i: int) -> None:
                out = stream_generate(
                    server.base_url, prompts[i], args.reply_tokens, f"s{i}-t{turn}"
                )
                meta = out["meta"]
                records.append(
                    {
                        "session": i,
                        "turn": turn,
                        "ttft": out["ttft"],
                        "logical_prompt": len(prompts[i]),
                        "cached": meta["cached_tokens"],
                        "prefilled": meta["prompt_tokens"] - meta["cached_tokens"],
                        "history": meta.get("kv_evict", [{}])[0].get("history_tokens", 0),
                    }
                )
                prompts[i] = (
                    prompts[i]
                    + out["output_ids"]
                    + [rngs[i].randrange(10, 2000) for _ in range(args.user_tokens)]
                )

            threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if turn == 0:
                state["peak_pool_held_turn1"] = info()["peak_pool_held_tokens"]
        state.update(info())
    return records, state


def run_sharing(args, model: str, flags: list[str]) -> dict:
    """`--sessions` requests at once, each the shared system prompt + its own message, page 16."""
    log_steps = ["--decode-log-interval", "1", *flags]
    cmd = server_cmd(model, args.sharing_pool, 16, args.budget, 16, log_steps)
    rng = random.Random(args.seed)
    system = [rng.randrange(10, 2000) for _ in range(args.system_tokens)]
    with ServerProcess(cmd, env={"OMP_NUM_THREADS": "1"}) as server:
        stream_generate(server.base_url, system + [1], 4, "warm")
        outs = [None] * args.sessions
        t0 = time.perf_counter()

        def one(i: int) -> None:
            outs[i] = stream_generate(
                server.base_url,
                system + [100 + i] * args.user_tokens,
                args.sharing_tokens,
                f"share-{i}",
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        st = vtoken_state(server.base_url, strict=True)
        log = server.log_text()
    retracted = count_retractions(log)
    return {
        "peak_pool_held_tokens": st["peak_pool_held_tokens"],
        "peak_running": st["peak_running_requests"],
        "cached_mean": statistics.fmean(o["meta"]["cached_tokens"] for o in outs),
        "ttft_p50_ms": round(1000 * statistics.median(o["ttft"] for o in outs), 1),
        "tokens_copied": st["tokens_moved"],
        "retractions": retracted,
        "wall_s": round(wall, 1),
        "output_tok_s": round(args.sessions * args.sharing_tokens / wall, 1),
    }


def summarize(mode: str, page_size: int, records: list[dict], turns: int) -> list[dict]:
    rows = []
    for turn in range(turns):
        rs = [r for r in records if r["turn"] == turn]
        ttft = [r["ttft"] * 1000 for r in rs]
        rows.append(
            {
                "page": page_size,
                "mode": mode,
                "turn": turn + 1,
                "ttft_p50_ms": round(statistics.median(ttft), 1),
                "ttft_mean_ms": round(statistics.fmean(ttft), 1),
                "logical_prompt_mean": round(statistics.fmean(r["logical_prompt"] for r in rs), 1),
                "prefilled_mean": round(statistics.fmean(r["prefilled"] for r in rs), 1),
                "cached_mean": round(statistics.fmean(r["cached"] for r in rs), 1),
                "history_mean": round(statistics.fmean(r["history"] for r in rs), 1),
            }
        )
    return rows


def markdown(args, rows: dict, states: dict) -> str:
    """`rows` and `states` keyed by (page size, mode)."""
    pages = sorted({p for p, _ in rows})
    modes = list(dict.fromkeys(m for _, m in rows))
    lines = [
        f"{args.sessions} sessions x {args.turns} turns sharing a {args.system_tokens}-token system prompt, "
        f"{args.user_tokens}-token user messages, {args.reply_tokens}-token replies, streamingllm "
        f"budget {args.budget} (interval 1 at page size 1, 16 at page size 16), pool {args.pool} "
        f"(`python -m sgl_vtoken_tools history --part history`)."
    ]
    for p in pages:
        lines += [
            "",
            f"Page size {p}: TTFT p50 in ms, prefilled and cached tokens per request (mean):",
            "",
            "| turn | logical prompt | "
            + " | ".join(f"{m} TTFT" for m in modes)
            + " | "
            + " | ".join(f"{m} prefilled" for m in modes)
            + " | "
            + " | ".join(f"{m} cached" for m in modes)
            + " |",
            "|---" * (2 + 3 * len(modes)) + "|",
        ]
        for k in range(args.turns):
            rs = [rows[p, m][k] for m in modes]
            lines.append(
                f"| {k + 1} | {rs[0]['logical_prompt_mean']:.0f} | "
                + " | ".join(f"{r['ttft_p50_ms']:.0f}" for r in rs)
                + " | "
                + " | ".join(f"{r['prefilled_mean']:.0f}" for r in rs)
                + " | "
                + " | ".join(f"{r['cached_mean']:.0f}" for r in rs)
                + " |"
            )
    lines += [
        "",
        "Pool slots held at eviction steps (peak; held = in rows or in locked radix nodes, not "
        "reclaimable). Bound after turn 1: system + sessions x (budget + interval, in pages, + one "
        "page); over all turns each row also holds its new message before the first eviction of "
        "the turn: + sessions x (user + 1).",
        "",
        "| page | mode | peak, turn 1 | peak, all turns | bound, turn 1 | bound, all turns | history hits "
        "| history tokens not prefilled |",
        "|---" * 8 + "|",
    ]
    for (p, mode), st in states.items():
        b = bound(args, p)
        lines.append(
            f"| {p} | {mode} | {st['peak_pool_held_turn1']} | {st['peak_pool_held_tokens']} | {b} | "
            f"{b + args.sessions * (args.user_tokens + 1)} | {st['history_hits']} | "
            f"{st['history_tokens_reused']} |"
        )
    return "\n".join(lines)


def sharing_markdown(args, results: dict) -> str:
    pages = args.system_tokens // 16 + args.sessions * (args.budget // 16 + 2)
    lines = [
        f"{args.sessions} requests at once, each a shared {args.system_tokens}-token system prompt + "
        f"{args.user_tokens} own tokens, {args.sharing_tokens} generated tokens, streamingllm budget "
        f"{args.budget}, interval 16, page size 16, pool {args.sharing_pool} "
        f"(`python -m sgl_vtoken_tools history --part sharing`). Bound: prompt once + sessions x "
        f"(budget/page + 2) pages = {pages * 16} slots.",
        "",
        "| radix cache | cached tokens per request | peak pool slots held | peak running | "
        "retractions | TTFT p50 (ms) | output tok/s | shared tokens copied |",
        "|---" * 8 + "|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['cached_mean']:.0f} | {r['peak_pool_held_tokens']} | {r['peak_running']} | "
            f"{r['retractions']} | {r['ttft_p50_ms']:.0f} | {r['output_tok_s']:.0f} | {r['tokens_copied']} |"
        )
    return "\n".join(lines)


def plot(rows: dict, out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (page, mode), rs in rows.items():
        ax.plot(
            [r["turn"] for r in rs],
            [r["ttft_p50_ms"] for r in rs],
            marker="o",
            linestyle="-" if page == 1 else "--",
            label=f"{mode}, page {page}",
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Multi-turn sessions: compacted-history reuse")
    ax.legend()
    save(fig, out, 120)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, __name__)
    p.add_argument("--model", default=None, help="model folder (default: the embedded tiny model)")
    common.numbers(
        p, sessions=16, turns=8, system_tokens=2048, user_tokens=32, reply_tokens=32, budget=512
    )
    p.add_argument("--pool", type=int, default=65536, help="--max-total-tokens of both servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-sizes", default="1,16", help="history part: comma-separated page sizes")
    p.add_argument(
        "--quick", action="store_true", help="4 sessions x 3 turns, system 256, budget 64"
    )
    p.add_argument("--part", choices=("history", "sharing", "all"), default="all")
    p.add_argument(
        "--sharing-tokens", type=int, default=200, help="sharing part: tokens generated per request"
    )
    p.add_argument(
        "--sharing-pool", type=int, default=16384, help="sharing part: --max-total-tokens"
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG of TTFT per turn")
    p.add_argument("--results-md", type=Path, default=None, help="rewrite its history section")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.system_tokens, args.budget = 4, 3, 256, 64
    model = args.model or resolve_model("tiny")
    if args.part in ("sharing", "all"):
        results = {}
        for mode, flags in (
            ("vtoken (shared)", []),
            ("none (--disable-radix-cache)", ["--disable-radix-cache"]),
        ):
            print(f"[bench_history] sharing: {mode}", file=sys.stderr)
            results[mode] = run_sharing(args, model, flags)
            print(json.dumps({"part": "sharing", "mode": mode, **results[mode]}), flush=True)
        if args.results_md:
            write_section(args.results_md, "sharing", sharing_markdown(args, results))
    if args.part == "sharing":
        return
    rows, states = {}, {}
    for page in (int(x) for x in args.page_sizes.split(",")):
        for mode, flags in MODES.items():
            print(
                f"[bench_history] page {page}, {mode}: {args.sessions} sessions x {args.turns} turns",
                file=sys.stderr,
            )
            records, state = run_mode(args, model, flags, page)
            rows[page, mode] = summarize(mode, page, records, args.turns)
            states[page, mode] = {
                k: state[k]
                for k in (
                    "peak_pool_held_turn1",
                    "peak_pool_held_tokens",
                    "history_hits",
                    "history_tokens_reused",
                    "evicted_tokens",
                    "pool_total_tokens",
                )
            }
            for row in rows[page, mode]:
                print(json.dumps(row), flush=True)
            print(
                json.dumps(
                    {
                        "page": page,
                        "mode": mode,
                        "summary": True,
                        **states[page, mode],
                        "bound_turn1": bound(args, page),
                    }
                ),
                flush=True,
            )
    if args.plot:
        plot(rows, args.plot)
    if args.results_md:
        write_section(args.results_md, "history", markdown(args, rows, states))
