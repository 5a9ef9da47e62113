#!/usr/bin/env python
"""How often a chat client's next turn reproduces the ids the server stored for its history.

    python scripts/probe_retokenize.py --model .cache/smollm2 --out docs/results/retokenize.jsonl

Each conversation: a system prompt and a user message (words drawn from a fixed list), the
model's greedy reply (`--reply-tokens`), then the next turn's prompt as a chat client builds it
(the chat template over the messages, the reply re-sent as its decoded text). One JSON line per
conversation (`history`: ids the server holds for turn 1; `common`: ids of turn 2's prompt equal to
them from the start; `exact`), then a summary line (`exact_share`, `reused_share`: history ids a
cut-at-first-difference match reuses). See `sgl_vtoken_tools.retokenize`.
"""

from __future__ import annotations

import argparse

from sgl_vtoken_tools.quality.cli import add_model_flags, json_lines

WORDS = (
    "the model reads a file and writes the answer to a tool call with numbers like 42 or 3.5 "
    'then it asks why the test failed on line 17 of main.py, see: {"ok": true}'
).split()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_vtoken_tools.retokenize import probe, summary

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    results = probe(model, tok, list(WORDS), args.conversations, args.reply_tokens, args.seed)
    with json_lines(args.out) as emit:
        for r in results:
            emit({"model": args.model, **r.as_dict()})
        emit({"model": args.model, "summary": True, **summary(results)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
