"""The load ladder: scored chat and agent sessions arriving at Poisson rates set as fractions of
what the KV pool holds, answers and speed per server cell and offered load.

    python -m sgl_vtoken_tools ladder --out ladder.jsonl --markdown ladder.md --plot ladder.png
    python -m sgl_vtoken_tools ladder --cells stock pressure --sessions 2 --loads 0.5,2 \\
        --repeats 1 --out /tmp/ladder_smoke.jsonl                          # smoke
    python -m sgl_vtoken_tools ladder --base-url URL --model PATH \\
        --cells full='{"policy": "none"}' server                        # a running server
    python -m sgl_vtoken_tools ladder --report ladder.jsonl --plot ladder.png   # table, plot again

Sessions (`tools/sgl_vtoken_tools/bench/ladder.py`): `--sessions N` of them, chats and agents at
`--mix CHAT:AGENT` (default 1:1, chats rounded half up). Chats are the `chat` command's pass-key
conversations (`chat_conversations.conversations`: the key, `--passages` passages to summarise, the
question; replies of at most `--max-tokens`); agents are the `agent` command's sessions
(`quality/agent_sessions.py`: the shared system prompt with tool definitions, the task, tool
outputs of `--tool-tokens` tokens sent as user messages, `--agent-turns` turns in all, the
question; replies of at most `--reply-tokens`). Every reply (greedy, stops at EOS) goes back
into the history as the assistant's message, the whole conversation re-sent as text through
`/v1/chat/completions`, streamed. The same sessions, request ids
(``ladder-r{repeat}-l{load index}-{session}-t{turn}``) and seeds in every cell and at every load.

Arrivals: session i (in a seeded order) arrives at ``unit[i] / rate``, `unit` the seeded arrival
times of a Poisson process of rate 1 (the first at 0): every cell and load plays one schedule,
scaled. A session plays its turns back to back from its arrival. The rate of a load:

    load = rate x D x K / pool        so        rate = load x pool / (D x K)

    K = the mean over sessions of the peak KV: its longest prompt + max_tokens, tokenized with
        the model's tokenizer and chat template (`chat_conversations.peak_tokens`; every reply taken
        at max_tokens, + 2 for its end); every session's must fit `--pool`, checked first
    D = the mean over sessions of the duration estimate: turns x max_tokens x t, t the decode
        seconds per token measured on the first server (the least TPOT of three greedy requests
        sent alone, `ladder.decode_seconds_per_token`) or `--decode-s-per-token` (pass the
        measured value on a busy machine: the rates follow it)
    pool = `--pool` (with `--base-url`: the server's own pool when it reports one)

By Little's law rate x D sessions are in the server at once on average, each holding up to K
tokens: load 1 offers about a pool's worth of peak KV (D leaves out prefill and queueing, so
real sessions last longer and the KV offered is higher). The rates go out in a `rates` line and
on stderr. `--loads` (default 0.1,0.25,0.5,1,2) play in order on one server per (cell, repeat),
its cache flushed (`/flush_cache`) before each load.

Cells (`--cells`: names of `tools/sgl_vtoken_tools/bench/server_cells.py`'s CELLS or ``name=flags``;
default stock, full, the README's chat command and pressure, the same under
`--kv-evict-trigger pressure`): CPU servers as the `chat` command starts them (`--max-total-tokens`
`--pool`, `--disable-overlap-schedule`, `--enable-cache-report`). `--repeats R` (default 3):
cells interleaved within a repeat, the full cache first (the others' answers are compared with
its answers of the same load and repeat), a fresh server per (cell, repeat). With `--base-url`
every cell plays on that running server, a cell being ``name=JSON`` (per-request
``custom_params.kv_evict``) or a bare name (its own flags), 5 s between cells (request ids repeat).

JSON lines (appended to `--out`): `config`; `rates`; per (cell, load, repeat) a `request` per
request as the `chat` command writes them (with `session_kind`, `arrival_s`, `load`, `rate`), an
`answer` per session and a `cell` line: answers (k of the sessions, per kind), `answers_vs_full`
(the full cache's answers on the same sessions and how many answered the same number),
`replies_vs_full` (the turns whose reply text is the full cache's), leaks,
output tok/s over the load's wall time (first arrival to last reply), TTFT and TPOT p50 / p95
(ms), retractions (the server's log, as the `chat` command counts them), evicted tokens
(``usage.kv_evict``), prompt tokens sent and computed. `--markdown`: one row per (cell, load),
medians over repeats with min-max; `--plot PNG`: answers and throughput against the offered
load, one line per cell.
"""

from __future__ import annotations

import argparse
import sys

from sgl_vtoken_tools.bench.cell_server import Plays, served_model
from sgl_vtoken_tools.bench.server_cells import CELLS, CHAT
from sgl_vtoken_tools.cli import common

DEFAULT_CELLS = ("stock", "full", CHAT, "pressure")
DEFAULT_LOADS = "0.1,0.25,0.5,1,2"


def sessions_of(args, tok) -> list:
    """The run's sessions in arrival order (`ladder.arrival_order` of the chats then agents)."""
    from sgl_vtoken_tools.bench import ladder
    from sgl_vtoken_tools.bench.chat_conversations import conversations
    from sgl_vtoken_tools.quality.agent_sessions import AgentSpec, agent_sessions

    n_chat, n_agent = ladder.mix_counts(args.sessions, *args.mix)
    out = []
    if n_chat:
        convs = conversations(
            args.split, n_chat, args.key_at, args.passages, args.seed, args.wheel_dir
        )
        out += [ladder.chat_session(c, tok, args.max_tokens) for c in convs]
    if n_agent:
        spec = AgentSpec(
            args.split, n_agent, tuple(args.agent_turns), tuple(args.tool_tokens), args.seed
        )
        out += [
            ladder.agent_session(s, tok, args.reply_tokens)
            for s in agent_sessions(tok, spec, args.wheel_dir)
        ]
    return ladder.arrival_order(out, args.seed)


def server_pool(url: str, fallback: int) -> int:
    """A running server's KV pool in tokens (the plugin's `pool_total_tokens`, else SGLang's
    `max_total_num_tokens`), `fallback` when it reports neither."""
    from sgl_vtoken_tools.bench import probe

    state = probe.vtoken_state(url) or {}
    info = probe.server_info(url) or {}
    return int(state.get("pool_total_tokens") or info.get("max_total_num_tokens") or fallback)


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.bench import ladder
    from sgl_vtoken_tools.bench.cell_server import resolve_model

    model = resolve_model(args.model)
    sessions = sessions_of(args, AutoTokenizer.from_pretrained(model))
    need = max(s.peak_tokens for s in sessions)
    if not args.base_url and need > args.pool:
        raise ValueError(
            f"--pool {args.pool} cannot hold the largest session (up to {need} tokens): raise "
            "--pool or lower --passages / --max-tokens / --agent-turns / --tool-tokens"
        )
    cells = common.cells_in_order(args, CELLS, "full")  # answers_vs_full needs its answers
    unit = ladder.unit_arrivals(len(sessions), args.seed)
    run = common.run_log(
        args,
        model,
        cells,
        True,
        split=args.split,
        seed=args.seed,
        mix=list(args.mix),
        sessions=[
            {"id": s.id, "kind": s.kind, "turns": len(s.turns), "peak_tokens": s.peak_tokens}
            for s in sessions
        ],
        arrivals_unit=[round(t, 6) for t in unit],
        key_at=args.key_at,
        passages=args.passages,
        max_tokens=args.max_tokens,
        agent_turns=args.agent_turns,
        tool_tokens=args.tool_tokens,
        reply_tokens=args.reply_tokens,
        loads=args.loads,
    )
    emit = run.emit
    rates: dict[float, float] | None = None
    full: dict[tuple[int, int], tuple[list[dict], list[dict]]] = {}  # answers, requests
    plays = Plays(bool(args.base_url))
    for rep in range(args.repeats):
        for name, flags in cells:
            with common.server_of(args, model, name, flags) as (url, log_path, kv_evict):
                model_id = served_model(url)
                if rates is None:  # once per run: every cell and repeat plays the same rates
                    rates = choose_rates(args, url, model_id, sessions, emit)
                for li, load in enumerate(args.loads):
                    with plays.play(url, log_path) as window:
                        reqs, wall = ladder.play_load(
                            url,
                            model_id,
                            sessions,
                            [t / rates[load] for t in unit],
                            kv_evict,
                            rid_prefix=f"ladder-r{rep}-l{li}",
                        )
                    answers = ladder.score(sessions, reqs)
                    tag = {"cell": name, "repeat": rep, "load": load, "rate": rates[load]}
                    for r in reqs + answers:
                        emit({**r, **tag})
                    if name == "full":
                        full[(rep, li)] = answers, reqs
                    ref_answers, ref_reqs = full.get((rep, li), (None, None))
                    c = ladder.cell_line(
                        answers, reqs, wall, window.log, window.evicted(), ref_answers, ref_reqs
                    )
                    emit({"kind": "cell", **tag, **c})
                    print(
                        f"{name} r{rep} load {load:g}: answers {c['answers']}/{c['sessions']}, "
                        f"{c['output_tokens_per_s']} tok/s, TTFT p50/p95 {c['ttft_p50_ms']}/"
                        f"{c['ttft_p95_ms']} ms, retractions {c['retractions']}, evicted "
                        f"{c['evicted_tokens']}, failed {c['failed']}, wall {c['wall_s']} s",
                        file=sys.stderr,
                        flush=True,
                    )
    run.close()
    return run.records


def choose_rates(args, url: str, model: str, sessions: list, emit) -> dict[float, float]:
    """The arrival rate of every load (`ladder.rate_for_load`), from `--decode-s-per-token` or
    the decode time measured on the server at `url`; emits the `rates` line and prints them."""
    from sgl_vtoken_tools.bench import ladder

    measured = args.decode_s_per_token is None
    spt = ladder.decode_seconds_per_token(url, model) if measured else args.decode_s_per_token
    pool = server_pool(url, args.pool) if args.base_url else args.pool
    rates = {load: ladder.rate_for_load(load, pool, sessions, spt) for load in args.loads}
    mean_s = sum(ladder.session_seconds(s, spt) for s in sessions) / len(sessions)
    mean_kv = sum(s.peak_tokens for s in sessions) / len(sessions)
    emit(
        {
            "kind": "rates",
            "decode_s_per_token": spt,
            "decode_source": "measured" if measured else "given",
            "pool": pool,
            "mean_session_s": round(mean_s, 3),
            "mean_peak_tokens": round(mean_kv, 1),
            "rates": {str(load): rate for load, rate in rates.items()},
        }
    )
    print(
        f"decode {spt * 1000:.1f} ms/token ({'measured' if measured else 'given'}), pool {pool}, "
        f"mean session {mean_s:.1f} s, mean peak KV {mean_kv:.0f} tokens",
        file=sys.stderr,
    )
    for load, rate in rates.items():
        print(
            f"load {load:g}: {rate:.4g} sessions/s (mean gap {1 / rate:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    return rates


def loads_arg(text: str) -> list[float]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"positive numbers separated by commas (got {text!r})")
    return vals


def mix_arg(text: str) -> tuple[int, int]:
    chat, sep, agent = text.partition(":")
    try:
        parts = int(chat), int(agent)
    except ValueError:
        parts = (-1, -1)
    if not sep or min(parts) < 0 or sum(parts) == 0:
        raise argparse.ArgumentTypeError(f"CHAT:AGENT, e.g. 1:1 or 1:0 (got {text!r})")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = common.play_parser(
        __doc__,
        __name__,
        DEFAULT_CELLS,
        2048,
        "--max-total-tokens of every server (at least the largest session's peak KV, checked "
        "before any server starts)",
        repeats_help="plays of every cell, interleaved",
    )
    p.add_argument(
        "--loads",
        type=loads_arg,
        default=loads_arg(DEFAULT_LOADS),
        help=f"offered loads, fractions of the pool, played in order (default {DEFAULT_LOADS})",
    )
    p.add_argument("--sessions", type=int, default=12, help="sessions per load")
    p.add_argument(
        "--mix", type=mix_arg, default=(1, 1), help="chat:agent ratio of the sessions (1:1)"
    )
    p.add_argument(
        "--decode-s-per-token",
        type=float,
        help="the duration estimate's seconds per decoded token (default: measured on the "
        "first server)",
    )
    common.chat_flags(p, "chats: ")
    common.pair_flag(
        p, "--agent-turns", [5, 6], "agents: turns in all (task, tool outputs, question)"
    )
    common.pair_flag(p, "--tool-tokens", [120, 240], "agents: tokens of each tool output")
    p.add_argument("--reply-tokens", type=int, default=64, help="agents: max_tokens of every turn")
    common.split_flags(p, seed_help="sessions, arrival order and times")
    common.output_flags(
        p,
        out_help="JSON lines file (appended)",
        plot_help="answers and throughput against the load",
        report_help="only render the table (and plot) of a run",
    )
    return p


def check(parser: argparse.ArgumentParser, args) -> None:
    """Bad flags stop here (status 2, naming the flag), before any model or server."""
    from sgl_vtoken_tools.quality.agent_sessions import AgentSpec

    common.at_least_one(
        parser,
        repeats=args.repeats,
        sessions=args.sessions,
        max_tokens=args.max_tokens,
        reply_tokens=args.reply_tokens,
        passages=args.passages,
        pool=args.pool,
    )
    if args.decode_s_per_token is not None and args.decode_s_per_token <= 0:
        parser.error(f"--decode-s-per-token must be > 0 (got {args.decode_s_per_token})")
    common.check_split(parser, args.split, args.seed)
    try:
        AgentSpec(args.split, 1, tuple(args.agent_turns), tuple(args.tool_tokens))
    except ValueError as e:
        flag = "--agent-turns" if "turns" in str(e) else "--tool-tokens"
        parser.error(f"{flag}: {e}")
    common.check_cells(parser, args, CELLS)


def main(argv: list[str] | None = None) -> int:
    from sgl_vtoken_tools.bench.ladder import plot, table

    return common.report_or_run(build_parser(), argv, check, table, run, plot=plot)
