"""A StreamingLLM chat that runs past the KV pool: 50 turns, each asking for a key it states.

Turn k's message states a 5-digit key (the split's fact phrasing), gives a passage of the
split's essays to read past, then asks for the key (the split's question); every reply is the
model's own (greedy, up to `--max-new` tokens) and feeds the next turn, so turn k's prompt is
the whole conversation so far: about 110 tokens a turn, past a 1,024-token pool by turn 10 and
some 5,500 tokens at turn 50. What is asked lies in the newest tokens, which StreamingLLM keeps;
the run shows whether the conversation stays answerable once the history is several times the
pool. Three servers, one after the other, each playing every conversation:

    full      stock SGLang on a pool that holds the whole conversation
    stock     stock SGLang on `--pool` tokens: it refuses the turn whose prompt no longer fits
              (HTTP 400); the conversation ends there
    evicting  `--pool` tokens, `--kv-evict streamingllm --kv-budget B --kv-sink S
              --kv-evict-interval I --kv-evict-config '{"prefill_chunk": C}'
              --disable-overlap-schedule`: each turn continues from the history the server
              stored and is evicted during its prefill

One JSON line per (server, conversation) with every turn (prompt tokens, reply, hit, cached
tokens, live KV tokens), then hits per (server, band of 10 turns).

    python -m sgl_vtoken_tools.quality.long_chat --split heldout --conversations 2 \\
        --out docs/results/long_chat_heldout.jsonl
"""

from __future__ import annotations

import argparse
import random
import time

from sgl_vtoken_tools.cli.common import numbers
from sgl_vtoken_tools.quality.cli import (
    served,
    server_flags,
    server_script_parser,
    server_tokenizer,
    write_run,
)
from sgl_vtoken_tools.quality.splits import PHRASINGS, _check, split_sentences
from sgl_vtoken_tools.quality.tasks import _excerpt, chat_ids, exact_number, next_turn_ids

BAND = 10  # turns per summary band


def conversations(
    split: str, num: int, turns: int, passage_tokens: int, tokenizer, seed: int = 0, wheel_dir=None
):
    """`num` conversations of `turns` (message, key) pairs from `split`; conversation i is the
    same whatever `num` is."""
    _check(split)
    sents, phrasings = split_sentences(split, wheel_dir), PHRASINGS[split]
    out = []
    for i in range(num):
        rng = random.Random(f"{split}/long-chat/{seed}/{i}")
        conv = []
        for k in range(turns):
            ph = phrasings[(i + k) % len(phrasings)]
            key = str(rng.randrange(10000, 100000))
            passage = "".join(_excerpt(tokenizer, sents, rng, passage_tokens)).strip()
            conv.append((f"{ph.fact.format(key=key)}\n\n{passage}\n\n{ph.question}", key))
        out.append(conv)
    return out


def play(client, tok, conv, label: str, name: str, max_new: int) -> dict:
    """One conversation on one server; it ends at the first refused turn (HTTP status kept)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt: list[int] = []
    out: list[int] = []
    turns, t0 = [], time.monotonic()
    for k, (message, key) in enumerate(conv):
        prompt = (
            chat_ids(tok, message)[0] if k == 0 else prompt + out + next_turn_ids(tok, message, out)
        )
        try:
            res = client.generate(prompt, f"{name}-{label}-t{k}", max_new, None, stop=eos)
        except RuntimeError as e:  # HTTP 400: the pool cannot hold the prompt
            turns.append({"turn": k + 1, "prompt": len(prompt), "refused": str(e)[:200]})
            break
        out = list(res["output_ids"])
        answer = tok.decode([t for t in out if t != eos], skip_special_tokens=True)
        rep = (res["meta_info"].get("kv_evict") or [{}])[0] or {}
        turns.append(
            {
                "turn": k + 1,
                "prompt": len(prompt),
                "hit": exact_number(answer, key),
                "answer": answer,
                "cached": res["meta_info"].get("cached_tokens"),
                "live_tokens": rep.get("live_tokens"),
                "prefill_evicted_tokens": rep.get("prefill_evicted_tokens"),
            }
        )
    return {
        "kind": "conversation",
        "server": label,
        "conversation": name,
        "turns": turns,
        "answered": sum("hit" in t for t in turns),
        "hits": sum(bool(t.get("hit")) for t in turns),
        "seconds": round(time.monotonic() - t0, 1),
    }


def summary(records: list[dict], turns: int) -> list[dict]:
    """Hits and answered turns per (server, band of `BAND` turns)."""
    out = []
    for server in dict.fromkeys(r["server"] for r in records):
        for lo in range(1, turns + 1, BAND):
            band = [
                t
                for r in records
                if r["server"] == server
                for t in r["turns"]
                if lo <= t["turn"] < lo + BAND
            ]
            asked = min(BAND, turns - lo + 1) * sum(r["server"] == server for r in records)
            out.append(
                {
                    "kind": "summary",
                    "server": server,
                    "turns": f"{lo}-{lo + BAND - 1}",
                    "asked": asked,
                    "answered": sum("hit" in t for t in band),
                    "hits": sum(bool(t.get("hit")) for t in band),
                    "max_prompt": max((t["prompt"] for t in band), default=0),
                }
            )
    return out


def servers(args) -> list[tuple[str, list[str]]]:
    config = {"prefill_chunk": args.prefill_chunk}
    return [
        ("full", server_flags(args, args.full_pool)),
        (f"stock, pool {args.pool}", server_flags(args, args.pool)),
        (
            f"streamingllm b{args.budget}, pool {args.pool}",
            server_flags(args, args.pool, "streamingllm", config),
        ),
    ]


def build_parser() -> argparse.ArgumentParser:
    ap = server_script_parser(__doc__, "the stock and evicting servers' pool", sink=4)
    numbers(ap, conversations=2, turns=50, passage_tokens=60)
    ap.add_argument("--full-pool", type=int, default=8192, help="the full cache's pool")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    tok = server_tokenizer(args.model)
    convs = conversations(
        args.split, args.conversations, args.turns, args.passage_tokens, tok, args.seed
    )
    plan = servers(args)

    def played():
        for label, flags in plan:
            with served(flags) as client:
                for i, conv in enumerate(convs):
                    name = f"long-chat-{args.split}-{args.seed}-{i}"
                    yield play(client, tok, conv, label, name, args.max_new)

    config = {**vars(args), "servers": dict(plan)}
    write_run(args.out, config, played(), lambda records: summary(records, args.turns))


if __name__ == "__main__":
    main()
