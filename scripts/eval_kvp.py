#!/usr/bin/env python
"""KVP against the heuristics on held-out text: retained future attention mass and perplexity.

    python scripts/eval_kvp.py --model .cache/tiny-lm --checkpoint .cache/kvp/kvp.safetensors \\
        --out .cache/kvp/eval.jsonl --plot docs/img/kvp_retained_mass.png

For each of `--num-seqs` held-out windows of `--seq-len` tokens (text, split and seed as in
`collect_traces.py --split heldout`, with `--seed`), the model runs once with full attention
(eager, fp32). Then every policy is replayed step by step as the server runs it at interval 1
(`sgl_vtoken_tools.kvp_eval`): a `--prompt` token prefill (attention policies see its last
`obs_window` queries), then before each new token t the row (positions < t) is cut to `budget`
by the library policy, from the traced keys / values and, for h2o / tova, from the
full-attention probabilities of the past queries restricted to the kept row and renormalized
per KV head. Reported per policy and budget:

* retained future attention mass: at each step t <= seq_len - horizon, the share of the
  attention that queries [t, t + horizon) pay to tokens < t (full attention, summed over layers
  and KV heads) that falls on the tokens the row kept, averaged over steps and sequences;
* perplexity: one teacher-forced forward where query t attends exactly to the row kept at step
  t plus itself (the Hugging Face masking of the server's exactness oracle), over every token.

`oracle` keeps, at each step, the row's tokens with the most future mass (it knows the future;
an upper bound for greedy eviction). Decisions use full-attention K/V; the perplexity forward
then recomputes hidden states under the mask. Prints JSON lines and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from sgl_vtoken_tools.corpus import text_windows
from sgl_vtoken_tools.hf_reference import load_model
from sgl_vtoken_tools.kvp_eval import POLICIES, Setup, evaluate_sequence


def plot(summary: list[dict], path: str, title: str) -> None:
    """Retained mass vs budget (left) and its difference to streamingllm (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 4))
    base = {r["budget"]: r["retained_mass"] for r in summary if r["policy"] == "streamingllm"}
    for pol in POLICIES:
        pts = sorted((r["budget"], r["retained_mass"]) for r in summary if r["policy"] == pol)
        if not pts:
            continue
        style = dict(marker="o", label=pol, linestyle="--" if pol == "oracle" else "-")
        ax.plot(*zip(*pts), **style)
        if base:
            dx.plot([b for b, _ in pts], [m - base[b] for b, m in pts], **style)
    for a, label in (
        (ax, "retained future attention mass"),
        (dx, "retained mass - streamingllm's"),
    ):
        a.set_xscale("log", base=2)
        a.set_xlabel("budget (live KV tokens)")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--budgets", nargs="+", type=int, default=[32, 64, 128, 256])
    p.add_argument("--ppl-budgets", nargs="+", type=int, default=[64, 128])
    p.add_argument(
        "--text",
        default=None,
        help="'stdlib' (default), 'pydoc' or a plain-text file, as for collect_traces.py",
    )
    p.add_argument("--heldout-every", type=int, default=10, help="as for collect_traces.py")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--horizon", type=int, default=128)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument(
        "--h2o-window", type=float, default=0.5, help="h2o recent window, fraction of the budget"
    )
    p.add_argument("--obs-window", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON lines file (default: stdout only)")
    p.add_argument("--plot", default=None, help="PNG of retained mass vs budget")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = load_model(args.model)
    setup = Setup(
        checkpoint=args.checkpoint,
        prompt=args.prompt,
        horizon=args.horizon,
        sink=args.sink,
        h2o_window=args.h2o_window,
        obs_window=args.obs_window,
    )
    seqs = text_windows(
        args.model, args.text, "heldout", args.num_seqs, args.seq_len, args.seed, args.heldout_every
    )
    lines, acc = [], {}
    full_nll, count = 0.0, 0
    for s, ids in enumerate(seqs):
        nll, n, records = evaluate_sequence(
            model, ids, setup, args.policies, args.budgets, args.ppl_budgets
        )
        full_nll, count = full_nll + nll, count + n
        for rec in records:
            lines.append({"seq": s, **rec})
            a = acc.setdefault(
                (rec["policy"], rec["budget"]), {"mass": [], "nll": 0.0, "tokens": 0, "ms": []}
            )
            a["mass"].append(rec["retained_mass"])
            a["ms"].append(rec["keep_ms"])
            a["nll"] += rec.get("nll", 0.0)
            a["tokens"] += rec.get("tokens", 0)
        print(
            json.dumps({"event": "seq", "seq": s, "elapsed_s": round(time.perf_counter() - t0, 1)}),
            file=sys.stderr,
            flush=True,
        )
    summary = [
        {
            "event": "summary",
            "policy": pol,
            "budget": b,
            "retained_mass": round(sum(a["mass"]) / len(a["mass"]), 4),
            "ppl": round(math.exp(a["nll"] / a["tokens"]), 3) if a["tokens"] else None,
            "keep_ms": round(sum(a["ms"]) / len(a["ms"]), 3),
        }
        for (pol, b), a in acc.items()
    ]
    summary.append(
        {
            "event": "summary",
            "policy": "full",
            "budget": None,
            "retained_mass": 1.0,
            "ppl": round(math.exp(full_nll / count), 3),
            "keep_ms": 0.0,
        }
    )
    out = open(args.out, "w") if args.out else None
    for rec in lines + summary:
        if out:
            out.write(json.dumps(rec) + "\n")
    for rec in summary:
        print(json.dumps(rec), flush=True)
    budgets = sorted(set(args.budgets))
    print(
        "\n| policy | "
        + " | ".join(f"mass @{b}" for b in budgets)
        + " | "
        + " | ".join(f"ppl @{b}" for b in args.ppl_budgets)
        + f" | ms per keep @{budgets[-1]} |"
    )
    print("|---" * (2 + len(budgets) + len(args.ppl_budgets)) + "|")
    by = {(r["policy"], r["budget"]): r for r in summary}
    for pol in args.policies:
        cells = [f"{by[(pol, b)]['retained_mass']:.3f}" for b in budgets]
        cells += [f"{by[(pol, b)]['ppl']:.2f}" for b in args.ppl_budgets]
        cells.append(f"{by[(pol, budgets[-1])]['keep_ms']:.2f}")
        print(f"| {pol} | " + " | ".join(cells) + " |")
    print(
        f"| full attention | {' | '.join('1.000' for _ in budgets)} | "
        + " | ".join(f"{by[('full', None)]['ppl']:.2f}" for _ in args.ppl_budgets)
        + " | - |"
    )
    if args.plot:
        title = f"Held-out text ({args.text or 'stdlib'}), {Path(args.model).name}, eviction at every step"
        plot([r for r in summary if r["budget"] in budgets], args.plot, title)
    print(
        json.dumps({"event": "done", "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True
    )


if __name__ == "__main__":
    main()
