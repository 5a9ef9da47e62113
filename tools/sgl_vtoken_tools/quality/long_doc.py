"""Documents longer than the KV pool, one question each, answered by a server (CPU).

The documents are the split's document questions (`splits.docqa_trials`: a 5-digit number
stated at a depth of an essay excerpt, the split's phrasings and depths), `--times` times the
pool long (default 2, 3 and 4). Two servers, one after the other:

    full      a pool that holds the longest document; each trial asks ``{"policy": "none"}``
    evicting  `--pool` tokens, `--kv-evict POLICY ... --kv-evict-config '{"prefill_chunk": C,
              "host_tokens": ...}'` with `--disable-overlap-schedule`; each trial asked without
              recall (``{"recall": 0}``) and with offload + recall R (``{"offload": true,
              "recall": R}``)

Without eviction during prefill SGLang refuses every such prompt (`pool - 6`). One JSON line
per (cell, trial): the hit (the first number answered is the whole key), the answer, the prompt
tokens, the tokens evicted during the prefill and recalled, the seconds; then hits per (cell,
times). Settings are the joint benchmark's chat setting; nothing here chooses them.

    python -m sgl_vtoken_tools.quality.long_doc --split heldout --pool 1024 \\
        --out docs/results/long_doc_heldout.jsonl
"""

from __future__ import annotations

import argparse
import time

from sgl_vtoken_tools.cli.common import numbers
from sgl_vtoken_tools.quality.cli import (
    hits_by,
    served,
    server_flags,
    server_script_parser,
    server_tokenizer,
    write_run,
)
from sgl_vtoken_tools.quality.splits import docqa_trials
from sgl_vtoken_tools.quality.tasks import Trial, exact_number


def trials(tok, split: str, pool: int, times: list[int], seed: int = 0, wheel_dir=None):
    """The split's document questions whose essay excerpts are `x * pool` tokens, for each x
    of `times` (``meta["times"]``)."""
    out = []
    for x in times:
        for t in docqa_trials(tok, split, [x * pool], seed, wheel_dir):
            out.append(Trial(t.task, t.id, t.prompt, t.answer, {**t.meta, "times": x}, t.span))
    return out


def ask(client, tok, trial: Trial, label: str, kv_evict: dict, max_new: int) -> dict:
    """One question under `kv_evict`; request id ``{trial}-{label}``."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    t0 = time.monotonic()
    res = client.generate(list(trial.prompt), f"{trial.id}-{label}", max_new, kv_evict, stop=eos)
    rep = (res["meta_info"].get("kv_evict") or [{}])[0] or {}
    answer = tok.decode([t for t in res["output_ids"] if t != eos], skip_special_tokens=True)
    return {
        "kind": "trial",
        "cell": label,
        "kv_evict": kv_evict,
        "trial": trial.id,
        **trial.meta,
        "hit": exact_number(answer, trial.answer),
        "expected": trial.answer,
        "answer": answer,
        "prefill_evicted_tokens": rep.get("prefill_evicted_tokens"),
        "recalled_tokens": rep.get("recalled_tokens"),
        "seconds": round(time.monotonic() - t0, 1),
    }


def summary(records: list[dict]) -> list[dict]:
    """Hits per (cell, times the pool)."""
    return hits_by(records, "cell", "times", ordered=True)


def servers(args, docs: list[Trial]) -> list[tuple[str, list[str], list[tuple[str, dict]]]]:
    """``(name, flags, cells)`` of the two servers: the full cache with a pool that holds the
    longest document, and the evicting one (`args.pool`) with and without recall, per request."""
    full_pool = max(len(t.prompt) for t in docs) + args.max_new + 256
    config = {"prefill_chunk": args.prefill_chunk, "host_tokens": 1 << 20}
    return [
        ("full", server_flags(args, full_pool), [("full", {"policy": "none"})]),
        (
            "evicting",
            server_flags(args, args.pool, args.policy, config),
            [
                (f"{args.policy} b{args.budget} prefill_chunk {args.prefill_chunk}", {"recall": 0}),
                (
                    f"{args.policy} b{args.budget} prefill_chunk {args.prefill_chunk}"
                    f" + recall {args.recall}",
                    {"offload": True, "recall": args.recall},
                ),
            ],
        ),
    ]


def build_parser() -> argparse.ArgumentParser:
    ap = server_script_parser(__doc__, "the evicting server's pool", sink=16)
    ap.add_argument("--times", type=int, nargs="+", default=[2, 3, 4], help="document / pool")
    ap.add_argument("--policy", default="h2o")
    numbers(ap, window=32, recall=192)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    tok = server_tokenizer(args.model)
    docs = trials(tok, args.split, args.pool, args.times, args.seed)
    plan = servers(args, docs)

    def asked():
        for _, flags, cells in plan:
            with served(flags) as client:
                for trial in docs:
                    for label, kv in cells:
                        yield ask(client, tok, trial, label, kv, args.max_new)

    config = {**vars(args), "servers": {n: f for n, f, _ in plan}}
    write_run(args.out, config, asked(), summary)


if __name__ == "__main__":
    main()
