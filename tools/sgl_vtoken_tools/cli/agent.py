"""Agent sessions on SmolLM2, speed and answers: stock SGLang, the full cache and eviction
settings on the same concurrent multi-turn tool-use sessions, each scored on a fact it was told early.

    python -m sgl_vtoken_tools agent --out docs/results/agent_smollm2.jsonl \\
        --markdown docs/results/agent_smollm2.md        # SmolLM2, held-out split, 3 repeats
    python -m sgl_vtoken_tools agent --cells stock "h2o b256" --sessions 2 --repeats 1   # smoke
    python -m sgl_vtoken_tools agent --base-url URL --model PATH --cells full='{"policy": "none"}' \\
        server                                          # a running server, per-request settings
    python -m sgl_vtoken_tools agent --report agent.jsonl  # the table again

Sessions (`tools/sgl_vtoken_tools/quality/agent_sessions.py`, split `--split`): a system prompt with
JSON tool definitions shared by every session, the user's task, tool outputs of `--tool-tokens`
tokens (logs, code search results, file listings, JSON records built from the split's essays),
`--turns` turns in all; the task or the first tool output states a 5-digit key once, the last
turn asks for it. Each reply (greedy, at most `--reply-tokens`, stops at EOS) goes back into the
history as a client would send it. Right when the reply's first number is the whole key.

Every cell starts one CPU server on the same pool (`--pool`, small enough that stock SGLang holds
only one or two sessions' histories, at least the longest session) and plays all sessions at
once `--repeats` times, the tree flushed between repeats, request ids
``agent-r{repeat}-{session}-t{turn}`` in every cell. Cells (`--cells`, `name=flags` for others):

    stock                     SGLang without sgl-vtoken (`bench.baseline`)
    full                      the plugin loaded, `--kv-evict none`: the full cache
    h2o b256                  h2o, budget 256, every 16 steps (the README's documents row)
    h2o b256 s16 w32 + host + recall 192
                              the budget trigger's chat command: 16 sinks, a recent window of
                              32, histories the radix cache evicts move to host memory and come
                              back on the next turn instead of a prefill, recall 192 in rounds
    pressure                  the README's chat command: the same under the pressure trigger,
                              with `prefill_chunk` 64; not a default cell: it needs
                              `--server-args=--disable-overlap-schedule` (then every cell's)

With `--base-url` every cell plays on that running server, a cell being ``name=JSON`` (the
per-request ``custom_params.kv_evict``) or a bare name (the server's own flags); its runs wait
5 s apart (SGLang aborts an id reused within 2 s of its stream's end). `--replies JSONL CELL`
feeds back that run's replies of CELL (its first repeat) instead of each server's own, so the
cells answer the same conversations (a server's reply to the last turn is still what is scored).

JSON lines: `config`, one `request` per request, one `answer` per session, one `summary` per
(cell, repeat) (`tools/sgl_vtoken_tools/bench/agent_score.py`: output tokens/s, prompt tokens
computed, mean TTFT, accuracy, agreement with the full cache's answers of the same repeat, later
turns by how their history came back, host bytes moved, device KV per session, retractions, peak
running and mean running: rows a decode step carried), then one `cell` line per cell (spreads
over repeats, throughput ratio to stock) and the markdown table.
"""

from __future__ import annotations

import argparse

from sgl_vtoken_tools.bench.cell_server import resolve_model
from sgl_vtoken_tools.bench.server_cells import CELLS as JOINT_CELLS
from sgl_vtoken_tools.bench.server_cells import CHAT
from sgl_vtoken_tools.cli import common

# The README's rows, flag for flag as the joint benchmark runs them (the first four the default).
CELLS = {name: JOINT_CELLS[name] for name in ("stock", "full", "h2o b256", CHAT, "pressure")}
DEFAULT_CELLS = ("stock", "full", "h2o b256", CHAT)


def longest_session(tok, sessions, reply_tokens: int) -> int:
    """Tokens of the longest session's last turn if every reply took `reply_tokens` (+ its end)."""
    from sgl_vtoken_tools.bench.chat_conversations import peak_tokens
    from sgl_vtoken_tools.quality.agent_sessions import SYSTEM

    def messages(sess) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}] + [
            {"role": "user", "content": text} for _, text in sess.turns
        ]

    return max(peak_tokens(tok, messages(s), reply_tokens) for s in sessions)


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.bench.agent_chat import load_replies, play
    from sgl_vtoken_tools.bench.agent_score import cell_lines, summarize
    from sgl_vtoken_tools.bench.joint import Send
    from sgl_vtoken_tools.quality.agent_sessions import AgentSpec, agent_sessions

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    spec = AgentSpec(
        args.split, args.sessions, tuple(args.turns), tuple(args.tool_tokens), args.seed
    )
    sessions = agent_sessions(tok, spec, args.wheel_dir)
    need = longest_session(tok, sessions, args.reply_tokens)
    if not args.base_url and need > args.pool:
        raise ValueError(
            f"--pool {args.pool} cannot hold the longest session (up to {need} tokens): raise "
            "--pool or lower --turns / --tool-tokens"
        )
    cells = common.cells_in_order(args, CELLS, "full")  # agreement needs its answers first
    replies = None
    if args.replies:
        path, cell = args.replies
        replies = load_replies(common.read_lines(path), cell)
    run = common.run_log(
        args,
        model,
        cells,
        False,
        spec={**vars(spec), "reply_tokens": args.reply_tokens, "tool_role": args.tool_role},
        session_tokens_max=need,
        replies=args.replies,
    )
    common.play_repeats(
        args,
        model,
        cells,
        run.emit,
        lambda url, model_id, kv_evict, rep: play(
            url,
            model_id,
            sessions,
            Send(kv_evict, f"agent-r{rep}", args.reply_tokens),
            tool_role=args.tool_role,
            replies=replies,
            concurrency=args.concurrency,
        ),
        summarize,
        lambda s: (
            f"{s['output_tokens_per_s']} tok/s, accuracy {s['accuracy']}, "
            f"agreement {s['agreement']}, failed {s['failed']}, wall {s['wall_s']} s"
        ),
        no_overlap=False,
    )
    return common.close_run(run, cell_lines)


def build_parser() -> argparse.ArgumentParser:
    p = common.play_parser(
        __doc__,
        __name__,
        DEFAULT_CELLS,
        6144,
        "--max-total-tokens of every server: small enough that stock holds one or two "
        "sessions, at least the longest session (checked before any server starts)",
        cells_help="cell names or name=flags",
    )
    p.add_argument("--concurrency", type=int, default=0, help="sessions in flight (0: all)")
    p.add_argument("--sessions", type=int, default=8)
    common.pair_flag(p, "--turns", [8, 10])
    common.pair_flag(p, "--tool-tokens", [200, 600])
    p.add_argument("--reply-tokens", type=int, default=64, help="max_tokens of every turn")
    p.add_argument("--tool-role", choices=("user", "tool"), default="user")
    p.add_argument(
        "--replies",
        nargs=2,
        metavar=("JSONL", "CELL"),
        help="feed back CELL's replies (first repeat) from that run's lines instead of each "
        "server's own, so every cell answers the same conversations",
    )
    common.split_flags(p)
    common.output_flags(p)
    return p


def check(parser: argparse.ArgumentParser, args) -> None:
    """Bad flags stop here (status 2, naming the flag), before any model or server."""
    from sgl_vtoken_tools.quality.agent_sessions import AgentSpec

    common.at_least_one(parser, repeats=args.repeats, reply_tokens=args.reply_tokens)
    try:
        AgentSpec(args.split, args.sessions, tuple(args.turns), tuple(args.tool_tokens))
    except ValueError as e:
        field = str(e).split(" ", 1)[0].split(".")[-1].rstrip(":").replace("num", "sessions")
        parser.error(f"--{field.replace('_', '-')}: {e}")
    common.check_cells(parser, args, CELLS)
    cells = [] if args.base_url else common.cells_in_order(args, CELLS)
    chunked = [name for name, flags in cells if "prefill_chunk" in str(flags)]
    if chunked and "--disable-overlap-schedule" not in args.server_args.split():
        parser.error(
            f"--cells {chunked[0]!r}: its prefill_chunk needs the overlap scheduler off; add "
            "--server-args --disable-overlap-schedule (every cell of the run then runs without it)"
        )


def main(argv: list[str] | None = None) -> int:
    from sgl_vtoken_tools.bench.agent_score import cell_lines, table

    return common.report_or_run(build_parser(), argv, check, table, run, cell_lines)
