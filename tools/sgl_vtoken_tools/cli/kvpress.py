"""NVIDIA kvpress on the same SmolLM2 weights, token ids and KV budgets as our policies.

    make kvpress-venv                                   # .venv-kvpress: torch, kvpress 0.5.5
    .venv/bin/python -m sgl_vtoken_tools quality --model .cache/smollm2 --split heldout \\
        --write-tasks .cache/docqa_heldout.jsonl        # the docqa trials as token ids
    PYTHONPATH=tools .venv-kvpress/bin/python -m sgl_vtoken_tools kvpress --model .cache/smollm2 \\
        --tasks .cache/docqa_heldout.jsonl --out docs/results/kvpress_smollm2.jsonl

Runs in its own environment (kvpress needs ``transformers<5.3``; SGLang a newer one), where the
tooling is not installed (``PYTHONPATH=tools``: the command line alone is imported, which needs the
standard library only), and reads only the task file: running presses imports nothing else of
this repository (`--report` and `--choose` read lines in the main environment,
`sgl_vtoken_tools.bench.kvpress_table`). Each press runs in
two modes:

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

    python -m sgl_vtoken_tools kvpress --report docs/results/kvpress_smollm2.jsonl \
        --ours docs/results/docqa_heldout_smollm2.jsonl     # the table (main environment)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from sgl_vtoken_tools.cli import common

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


def parse_press(spec: str) -> tuple[str, str, dict, tuple[str, ...]]:
    """``name[:key=value,...]`` -> ``(name, kvpress class, options, modes)``: the press of
    PRESSES with its options overridden (integers, floats, ``true``/``false``)."""
    name, _, rest = spec.partition(":")
    if name not in PRESSES:
        raise ValueError(f"--presses {spec!r}: unknown press {name!r}; choose from {list(PRESSES)}")
    cls, opts, modes = PRESSES[name]
    opts = dict(opts)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not (eq and key and value):
            raise ValueError(f"--presses {spec!r}: options are key=value (got {item!r})")
        opts[key] = _option(spec, value)
    return name, cls, opts, modes


def _option(spec: str, value: str):
    if value in ("true", "false"):
        return value == "true"
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    raise ValueError(f"--presses {spec!r}: {value!r} is not a number, true or false")


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


def press_runs(args) -> list[tuple[str, str]]:
    """``(spec, mode)`` to run: `--presses` (default: every press, or none with `--presses-from`)
    in every mode of `--modes` the press has, then the choices of `--presses-from` (a tuning
    run's ``choice`` lines) in their own mode."""
    specs = args.presses if args.presses is not None else [] if args.presses_from else PRESSES
    runs = [(spec, mode) for spec in specs for mode in parse_press(spec)[3] if mode in args.modes]
    for path in args.presses_from or []:
        for line in open(path):
            c = json.loads(line)
            if c.get("kind") == "choice" and (c["spec"], c["mode"]) not in runs:
                runs.append((c["spec"], c["mode"]))
    return runs


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
    runs = press_runs(args)
    for spec, _ in runs:  # every option a field of its press, before any model loads
        name, cls, opts, _ = parse_press(spec)
        known = {f.name for f in dataclasses.fields(getattr(kvpress, cls))}
        if set(opts) - known:
            raise SystemExit(
                f"--presses {spec!r}: {cls} has no option {sorted(set(opts) - known)[0]!r}; "
                f"its options: {sorted(known - {'compression_ratio'})}"
            )
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
        for spec, mode in runs:
            name, cls, opts, _ = parse_press(spec)
            model = model_for(name)
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
                        "press": spec,
                        "options": opts,
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
                "runs": runs,
                "budgets": args.budgets,
            }
        )
        + "\n"
    )
    if out is not sys.stdout:
        out.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, __name__)
    p.add_argument("--model", help="Hugging Face folder (.cache/smollm2: the fp32 checkpoint)")
    p.add_argument("--tasks", help="JSON lines of `quality --write-tasks`")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="JSONL",
        help="only print the table of these runs' lines (no kvpress needed); with --ours, "
        "our `quality` docqa lines beside them and the StreamingLLM agreement",
    )
    p.add_argument(
        "--ours",
        metavar="JSONL",
        help="our `quality --tasks docqa` run on the same task file",
    )
    p.add_argument(
        "--tuned-table",
        nargs="+",
        metavar="SPLIT=JSONL[,JSONL]",
        help="only print each press at its defaults and tuned (--choices), one column per "
        "split and budget, from these runs' lines",
    )
    p.add_argument("--choices", nargs="+", metavar="JSONL", help="--choose lines (--tuned-table)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument(
        "--presses",
        nargs="+",
        default=None,
        metavar="NAME[:KEY=VALUE,...]",
        help=f"presses ({', '.join(PRESSES)}), each with options of its kvpress class "
        "overriding its defaults, e.g. snapkv:window_size=16,kernel_size=1",
    )
    p.add_argument(
        "--presses-from",
        nargs="+",
        metavar="JSONL",
        help="also run the presses a tuning run chose (its --choose lines), each in its mode",
    )
    p.add_argument(
        "--choose",
        nargs="+",
        metavar="JSONL",
        help="only print the choice per press and mode of these tuning runs' lines (the spec "
        "with the most hits; ties: the one run first) as JSON lines",
    )
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
    for spec in args.presses or []:
        try:
            parse_press(spec)
        except ValueError as e:
            parser.error(str(e))
    if args.choose or args.report or args.tuned_table:  # the main environment: reads lines
        from sgl_vtoken_tools.bench import kvpress_table

        if args.report or args.tuned_table:
            return kvpress_table.report(args)
        records = [json.loads(line) for path in args.choose for line in open(path)]
        for c in kvpress_table.choose(records):
            print(json.dumps(c))
        return 0
    if not (args.model and args.tasks):
        parser.error("--model and --tasks are required (unless --report)")
    return run(args)
