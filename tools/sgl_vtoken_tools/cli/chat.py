"""Chats in rounds: pass-key conversations through the OpenAI chat API, as chat clients send
them (the whole conversation re-sent as text every turn), answers and speed per server cell.

    python -m sgl_vtoken_tools chat --conversations 12 --repeats 3 --cells stock \\
        "h2o b256 s16 w32 + host + recall 192" pressure --out chat.jsonl --markdown chat.md
    python -m sgl_vtoken_tools chat --one-at-a-time --conversations 10 --pool 16384 \\
        --cells full pressure --key-at passage --out chat.jsonl      # the idle-pool case
    python -m sgl_vtoken_tools chat --cells stock pressure --conversations 2 --repeats 1   # smoke
    python -m sgl_vtoken_tools chat --one-at-a-time --conversations 1 --passages 48 --pool 1024 \\
        --passage-words 50 70 --max-tokens 32 \\
        --past-pool --cells pressure --repeats 1 --out chat.jsonl     # 50 turns, past the pool
    python -m sgl_vtoken_tools chat --base-url URL --model PATH \\
        --cells full='{"policy": "none"}' server                       # a running server
    python -m sgl_vtoken_tools chat --report chat.jsonl                   # the table again

Conversations (`tools/sgl_vtoken_tools/bench/chat_conversations.py`; SmolLM2-135M-Instruct by
default, greedy): `--key-at first`: turn 1 states a 5-digit pass key ("Remember this pass key:
48213. ..."), turns 2 to `--passages` + 1 ask for a summary of an essay passage of 160-180 words,
the last turn asks for the key; `--key-at passage`: turn 1 is a passage to summarise too and the
key statement sits between the middle sentences of turn 2's passage. Every reply (at most
`--max-tokens`, stops at EOS) goes back into the history as the assistant's message. Phrasings
(key statement, summary request, question: 5 variants each, none of them a sentence of
`quality/chats.py`) are picked per conversation from its seed. `--split tuning|heldout|final`
reads disjoint essays (the Paul Graham essays the quality harness reads; nothing is downloaded)
and disjoint seed ranges; conversation i is the same whatever `--conversations` is.

Play: in rounds (default): every conversation sends turn k at once, one thread each, and turn
k + 1 goes once all have answered (on a small pool a history has left the device before its next
turn); `--one-at-a-time`: each conversation alone, turn by turn, one after another (an idle pool).

Scoring: a conversation answers when the first 5-digit number of its last reply is its key;
a reply that holds another conversation's key is a leak (must be 0).

Cells (`--cells`: names of `tools/sgl_vtoken_tools/bench/server_cells.py`'s CELLS or ``name=flags``;
default stock, full, the README's chat command and pressure):

    stock       SGLang without sgl-vtoken
    full        the plugin loaded, `--kv-evict none`: the full cache
    h2o b256 s16 w32 + host + recall 192
                the README's chat command: h2o budget 256, 16 sinks, a window of 32, every 16
                steps, host histories, recall 192
    pressure    the same under `--kv-evict-trigger pressure`: evicts only when the pool is short

Every cell starts one server (`--device cpu --attention-backend torch_native`, `--max-total-tokens`
`--pool`, `--disable-overlap-schedule`, `--enable-cache-report`, 127.0.0.1 on a free port, always
stopped); `--repeats R` plays every cell R times, a fresh server each time, cells interleaved
per repeat (stock first, then the others in order). With `--base-url` every cell plays on that
running server, a cell being ``name=JSON`` (per-request ``custom_params.kv_evict``) or a bare
name (the server's flags), its cache flushed first.

JSON lines (appended to `--out`): `config`; a `request` per request (cell, repeat, conversation,
turn, prompt_tokens, cached_tokens, completion_tokens, latency, ttft, `usage.kv_evict` figures
when present: evicted_tokens, evictions, evicted_at, history_source, ... and the whole report as
`kv_evict`, the `reply` and the other keys it holds as `leaked`); an `answer` per conversation;
a `cell` per (cell, repeat): answers of conversations, leaks, output tok/s (completion tokens over
the wall seconds of the play), prompt tokens sent and computed (sent less cached), evicted
tokens, retractions and peak running (the server's log), later turns by how their history came
back, mean latency and the wall seconds of each round. `--markdown`: a table per cell of answers,
leaks, tok/s, prompt tokens computed and retractions (medians over repeats with min-max).
"""

from __future__ import annotations

import sys

from sgl_vtoken_tools.bench.cell_server import Plays, served_model
from sgl_vtoken_tools.bench.server_cells import CELLS, CHAT
from sgl_vtoken_tools.cli import common

DEFAULT_CELLS = ("stock", "full", CHAT, "pressure")


def longest(tok, convs, max_tokens: int) -> int:
    """Tokens of the longest conversation's last turn if every reply took `max_tokens` (+ its end)."""
    from sgl_vtoken_tools.bench.chat_conversations import peak_tokens

    return max(
        peak_tokens(tok, [{"role": "user", "content": m} for m in c.messages], max_tokens)
        for c in convs
    )


def run(args) -> list[dict]:
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.bench.cell_server import resolve_model
    from sgl_vtoken_tools.bench.chat_conversations import conversations
    from sgl_vtoken_tools.bench.chat_rounds import cell_line, play, score
    from sgl_vtoken_tools.bench.joint import Send

    model = resolve_model(args.model)
    convs = conversations(
        args.split,
        args.conversations,
        args.key_at,
        args.passages,
        args.seed,
        args.wheel_dir,
        tuple(args.passage_words),
    )
    need = longest(AutoTokenizer.from_pretrained(model), convs, args.max_tokens)
    if not args.base_url and not args.past_pool and need > args.pool:
        raise ValueError(
            f"--pool {args.pool} cannot hold the longest conversation (up to {need} tokens): "
            "raise --pool, lower --passages / --max-tokens, or pass --past-pool"
        )
    cells = common.cells_in_order(args, CELLS, "stock")
    mode = "one-at-a-time" if args.one_at_a_time else "rounds"
    run = common.run_log(
        args,
        model,
        cells,
        True,
        split=args.split,
        seed=args.seed,
        key_at=args.key_at,
        mode=mode,
        conversations=len(convs),
        passages=args.passages,
        passage_words=list(args.passage_words),
        max_tokens=args.max_tokens,
        conversation_tokens_max=need,
    )
    emit = run.emit
    plays = Plays(bool(args.base_url))
    for rep in range(args.repeats):
        for name, flags in cells:
            with common.server_of(args, model, name, flags) as (url, log_path, kv_evict):
                with plays.play(url, log_path) as window:
                    reqs, wall, rounds = play(
                        url,
                        served_model(url),
                        convs,
                        Send(kv_evict, f"chat-r{rep}", args.max_tokens),
                        one_at_a_time=args.one_at_a_time,
                    )
            answers = score(convs, reqs)
            tag = {"cell": name, "repeat": rep, "key_at": args.key_at, "mode": mode}
            for r in reqs + answers:
                emit({**r, **tag})
            c = cell_line(answers, reqs, wall, rounds, window.log, window.evicted())
            emit({"kind": "cell", **tag, **c})
            print(
                f"{name} r{rep}: answers {c['answers']}/{c['conversations']}, leaks {c['leaks']}, "
                f"{c['output_tokens_per_s']} tok/s, computed {c['prompt_tokens_computed']} of "
                f"{c['prompt_tokens_sent']}, evicted {c['evicted_tokens']}, retractions "
                f"{c['retractions']}, failed {c['failed']}, wall {c['wall_s']} s",
                file=sys.stderr,
                flush=True,
            )
    run.close()
    return run.records


def build_parser():
    p = common.play_parser(
        __doc__,
        __name__,
        DEFAULT_CELLS,
        2048,
        "--max-total-tokens of every server (at least the longest conversation, checked before "
        "any server starts)",
        repeats_help="plays of every cell, interleaved",
    )
    p.add_argument("--conversations", type=int, default=12)
    common.chat_flags(p)
    common.pair_flag(p, "--passage-words", [160, 180], "words of every passage", ("LEAST", "MOST"))
    p.add_argument(
        "--past-pool",
        action="store_true",
        help="conversations may outgrow --pool (a turn a server refuses counts as failed)",
    )
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="each conversation alone, turn by turn (default: all conversations in rounds)",
    )
    common.split_flags(p, seed_help="within the split's seed range")
    common.output_flags(p, out_help="JSON lines file (appended)")
    return p


def check(parser, args) -> None:
    """Bad flags stop here (status 2, naming the flag), before any model or server."""
    common.at_least_one(
        parser,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        conversations=args.conversations,
        passages=args.passages,
        pool=args.pool,
    )
    least, most = args.passage_words
    if not 1 <= least <= most:
        parser.error(f"--passage-words: need 1 <= LEAST <= MOST (got {least} {most})")
    common.check_split(parser, args.split, args.seed)
    common.check_cells(parser, args, CELLS)


def main(argv: list[str] | None = None) -> int:
    from sgl_vtoken_tools.bench.chat_rounds import table

    return common.report_or_run(build_parser(), argv, check, table, run)
