#!/usr/bin/env python
"""NVIDIA kvpress on the same SmolLM2 weights, token ids and KV budgets as our policies.

    make kvpress-venv                                   # .venv-kvpress: torch, kvpress 0.5.5
    .venv/bin/python scripts/eval_quality.py --model .cache/smollm2 --split heldout \\
        --write-tasks .cache/docqa_heldout.jsonl        # the docqa trials as token ids
    .venv-kvpress/bin/python scripts/kvpress_eval.py --model .cache/smollm2 \\
        --tasks .cache/docqa_heldout.jsonl --out docs/results/kvpress_smollm2.jsonl

Runs in its own environment (kvpress needs ``transformers<5.3``; SGLang a newer one) and reads
only the task file: it imports nothing of this repository. Each press runs in two modes:

    aware      the whole prompt (question included) is prefilled under the press, which keeps
               `budget` tokens of it; the first answer token comes from that prefill (full
               attention), the rest decode against the compressed cache: our policies' order
               (prefill whole, cut to the budget before the first decoded token)
    agnostic   the prompt up to the question is prefilled under the press, which keeps
               ``budget - question tokens`` of it, then the question is prefilled against the
               compressed cache, as kvpress's pipeline does with ``question=``: the press never
               sees the question; the cache holds `budget` tokens when the answer starts

Greedy decoding, at most `--max-new` tokens, stopping at ``<|im_end|>``; a hit is the first
number of the reply equal to the answer. kvpress presses keep their own tokens per KV head
(ours keep one set of tokens per sequence, which is what frees slots); StreamingLLM keeps the
same tokens in every head, so with ``n_sink`` = our sinks (16) it keeps exactly what our
``streamingllm`` keeps: its aware answers must equal ours (docs/benchmarks.md, "kvpress side by side").
One JSON line per (press, mode, budget, trial), then one ``summary`` per (task, press, mode,
budget).

    python scripts/kvpress_eval.py --report docs/results/kvpress_smollm2.jsonl \
        --ours docs/results/docqa_heldout_smollm2.jsonl     # the table, in either environment
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

PRESSES = {  # name: (kvpress class, options, modes)
    "streamingllm": ("StreamingLLMPress", {"n_sink": 16}, ("aware", "agnostic")),
    "snapkv": ("SnapKVPress", {}, ("aware", "agnostic")),
    "tova": ("TOVAPress", {}, ("aware", "agnostic")),
    "knorm": ("KnormPress", {}, ("agnostic",)),  # key norms only: the question changes nothing
    "observed_attention": ("ObservedAttentionPress", {}, ("aware", "agnostic")),
    "expected_attention": (
        "ExpectedAttentionPress",
        {},
        ("agnostic",),
    ),  # question-agnostic by design
}
MODES = ("aware", "agnostic")


def ratio_for(length: int, kept: int) -> float:
    """The compression ratio under which kvpress keeps exactly `kept` of `length` tokens
    (it keeps ``int(length * (1 - ratio))``; the half token absorbs float rounding)."""
    if not 0 < kept < length:
        raise ValueError(f"keep {kept} of {length} tokens: the budget must lie in (0, {length})")
    return 1.0 - (kept + 0.5) / length


def split_prompt(task: dict, mode: str, budget: int) -> tuple[list[int], list[int], int]:
    """``(compressed ids, ids fed after compression, tokens the press keeps)`` of one trial."""
    ids = task["prompt"]
    if mode == "aware":
        return ids, [], budget
    if mode != "agnostic":
        raise ValueError(f"mode {mode!r}: choose from {list(MODES)}")
    q = task["question_at"]
    if not 0 < q < len(ids):
        raise ValueError(
            f"trial {task['trial']}: question_at {q} outside the prompt of {len(ids)} tokens"
        )
    keep = budget - (len(ids) - q)
    if keep <= 0:
        raise ValueError(
            f"trial {task['trial']}: budget {budget} is smaller than the question "
            f"({len(ids) - q} tokens)"
        )
    return ids[:q], ids[q:], keep


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def summarize(records: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r.get("task"), r["press"], r["mode"], r["budget"]), []).append(r)
    return [
        {
            "kind": "summary",
            "task": task,
            "press": p,
            "mode": m,
            "budget": b,
            "hits": sum(r["hit"] for r in rs),
            "trials": len(rs),
            "accuracy": round(sum(r["hit"] for r in rs) / len(rs), 4),
        }
        for (task, p, m, b), rs in cells.items()
    ]


def agreement(
    ours: list[dict],
    presses: list[dict],
    setting: str = "streamingllm",
    press: str = "streamingllm",
    mode: str = "aware",
) -> list[dict]:
    """Per budget: trials whose greedy answer ids (both end with ``<|im_end|>`` when the reply
    closes) are equal in our `setting` and kvpress's `press` in `mode`, and the trials that differ."""
    mine = {
        (r["trial"], r["budget"]): r["output_ids"]
        for r in ours
        if r.get("kind") == "trial" and r.get("setting") == setting
    }
    out = []
    for b in sorted({r["budget"] for r in presses if r.get("kind") == "press"}):
        theirs = {
            r["trial"]: r["output_ids"]
            for r in presses
            if r.get("kind") == "press"
            and r["press"] == press
            and r["mode"] == mode
            and r["budget"] == b
        }
        both = [t for t in theirs if (t, b) in mine]
        differ = [t for t in both if mine[(t, b)] != theirs[t]]
        out.append(
            {
                "kind": "agreement",
                "setting": setting,
                "press": press,
                "mode": mode,
                "budget": b,
                "equal": len(both) - len(differ),
                "trials": len(both),
                "differ": differ,
            }
        )
    return out


def table(ours: list[dict], presses: list[dict]) -> str:
    """Markdown: docqa hits / trials per budget, our settings (full cache first) then every
    kvpress press and mode, from the trial and press records alone."""
    rows: dict[str, dict] = {}
    for r in ours:
        if r.get("kind") == "trial" and r.get("task") == "docqa":
            rows.setdefault(f"ours `{r['setting']}`", {}).setdefault(r["budget"], []).append(
                r["hit"]
            )
    for r in presses:
        if r.get("kind") == "press":
            rows.setdefault(f"kvpress `{r['press']}` ({r['mode']})", {}).setdefault(
                r["budget"], []
            ).append(r["hit"])
    budgets = sorted({b for cells in rows.values() for b in cells if b is not None})
    full = next((cells[None] for cells in rows.values() if None in cells), None)
    lines = [
        f"full cache: {sum(full)}/{len(full)}\n" if full else "",
        "| setting | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for name, cells in rows.items():
        if None in cells:
            continue
        lines.append(
            f"| {name} | "
            + " | ".join(f"{sum(cells[b])}/{len(cells[b])}" if b in cells else "-" for b in budgets)
            + " |"
        )
    return "\n".join(line for line in lines if line) + "\n"


def report(args) -> int:
    presses = [json.loads(line) for path in args.report for line in open(path)]
    ours = [json.loads(line) for line in open(args.ours)] if args.ours else []
    md = table(ours, presses)
    if ours:
        agree = agreement(ours, presses)
        md += (
            "\nStreamingLLM (aware) vs ours `streamingllm`, equal greedy answers: "
            + ", ".join(f"budget {a['budget']} {a['equal']}/{a['trials']}" for a in agree)
            + "\n"
        )
        for a in agree:
            print(json.dumps(a), file=sys.stderr)
    print(md)
    if args.markdown:
        open(args.markdown, "w").write(md)
    return 0


def run(args) -> int:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.model)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    tasks = [json.loads(line) for line in open(args.tasks)]
    models = {}

    def model_for(press: str):
        impl = (
            "eager" if press == "observed_attention" else "sdpa"
        )  # it reads the attention weights
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(
                args.model, dtype=torch.float32, attn_implementation=impl
            ).eval()
        return models[impl]

    out = open(args.out, "w") if args.out else sys.stdout
    records = []
    with torch.no_grad():
        for name in args.presses:
            cls, opts, modes = PRESSES[name]
            model = model_for(name)
            for mode in (m for m in modes if m in args.modes):
                for budget in args.budgets:
                    for t in tasks:
                        t0 = time.monotonic()
                        ctx, rest, keep = split_prompt(t, mode, budget)
                        press = getattr(kvpress, cls)(
                            compression_ratio=ratio_for(len(ctx), keep), **opts
                        )
                        cache = DynamicCache()
                        with press(model):
                            res = model(
                                input_ids=torch.tensor([ctx]),
                                past_key_values=cache,
                                logits_to_keep=1,
                            )
                        kept = cache.get_seq_length()
                        if rest:  # the question, against the compressed cache at its own positions
                            pos = torch.arange(len(ctx), len(ctx) + len(rest))[None]
                            res = model(
                                input_ids=torch.tensor([rest]),
                                past_key_values=cache,
                                position_ids=pos,
                                logits_to_keep=1,
                            )
                        ids = [int(res.logits[0, -1].argmax())]
                        pos = len(t["prompt"])
                        while ids[-1] != eos and len(ids) < args.max_new:
                            res = model(
                                input_ids=torch.tensor([[ids[-1]]]),
                                past_key_values=cache,
                                position_ids=torch.tensor([[pos]]),
                            )
                            ids.append(int(res.logits[0, -1].argmax()))
                            pos += 1
                        text = tok.decode(ids, skip_special_tokens=True)
                        r = {
                            "kind": "press",
                            "press": name,
                            "mode": mode,
                            "budget": budget,
                            "trial": t["trial"],
                            "kept": kept,
                            "hit": first_number(text) == t["answer"],
                            "expected": t["answer"],
                            "answer": text,
                            "output_ids": ids,
                            "seconds": round(time.monotonic() - t0, 3),
                        }
                        for k in ("task", "length", "depth", "phrasing", "prompt_tokens"):
                            r[k] = t.get(k)
                        records.append(r)
                        out.write(json.dumps(r) + "\n")
                        out.flush()
    for s in summarize(records):
        out.write(json.dumps(s) + "\n")
        print(
            f"{s['press']:>20} {s['mode']:>8} {s['budget']:>5}: {s['hits']}/{s['trials']}",
            file=sys.stderr,
        )
    from importlib.metadata import version

    out.write(
        json.dumps(
            {
                "kind": "run",
                "kvpress": version("kvpress"),
                "transformers": version("transformers"),
                "torch": torch.__version__,
                "threads": args.threads,
                "tasks": args.tasks,
                "presses": args.presses,
                "budgets": args.budgets,
            }
        )
        + "\n"
    )
    if out is not sys.stdout:
        out.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="Hugging Face folder (.cache/smollm2: the fp32 checkpoint)")
    p.add_argument("--tasks", help="JSON lines of eval_quality.py --write-tasks")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSONL",
        help="only print the table of these runs' lines (no kvpress needed); with --ours, "
        "our eval_quality.py docqa lines beside them and the StreamingLLM agreement",
    )
    p.add_argument(
        "--ours",
        metavar="JSONL",
        help="our eval_quality.py --tasks docqa run on the same task file",
    )
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    p.add_argument(
        "--max-new", type=int, default=12, help="answer tokens (our docqa runs decode 12)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    p.add_argument("--out", help="JSON lines file (default: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report:
        return report(args)
    if not (args.model and args.tasks):
        parser.error("--model and --tasks are required (unless --report)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
