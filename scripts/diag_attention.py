#!/usr/bin/env python
"""Where the prompt's last queries put their attention, per layer, on passkey prompts.

    python scripts/diag_attention.py --model .cache/smollm2 --out docs/results/attention_smollm2.jsonl

For each passkey trial, the probabilities of the last `--obs-window` prompt queries (the
statistic an attention policy starts from, summed over those queries and over the query heads of
each KV head) are ranked among the evictable tokens (after the sinks, before the recent window).
One JSON line per (trial, layer): the mass on the sinks, and per KV head the rank of the
needle's best-ranked digit; then one per trial with the digits kept by the top `--keep` of the
score summed over all layers versus over `--upper` layers only, and the tokens the all-layer
sum ranks highest.
"""

from __future__ import annotations

import argparse
import sys

from sgl_vtoken_tools.quality.cli import add_model_flags, json_lines, load


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[1000])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--obs-window", type=int, default=16)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--keep", type=int, default=80, help="scored slots: budget - sinks - window")
    p.add_argument("--upper", default="15-29", help="layer range of the restricted sum")
    args = p.parse_args(argv)

    tok, model = load(args.model, args.threads)
    import torch

    from sgl_vtoken_tools.quality import tasks
    from sgl_vtoken_tools.quality.fastref import prefill

    lo_l, hi_l = map(int, args.upper.split("-"))
    with json_lines(args.out) as emit:
        for t in tasks.passkey_trials(tok, args.lengths, args.depths):
            n = len(t.prompt)
            digits = [i for i in range(*t.span) if tok.decode([t.prompt[i]]).strip().isdigit()]
            probs = prefill(model, list(t.prompt), args.obs_window).probs.sum(0)  # [n, L, H]
            cand = torch.zeros(n, dtype=torch.bool)
            cand[args.sink : n - args.window] = True
            for layer in range(probs.shape[1]):
                ranks = []
                for h in range(probs.shape[2]):
                    s = probs[:, layer, h].masked_fill(~cand, -1.0)
                    order = s.argsort(descending=True).argsort()
                    ranks.append(int(order[digits].min()))
                emit(
                    {
                        "kind": "layer",
                        "trial": t.id,
                        "layer": layer,
                        "sink_mass": round(
                            float(probs[: args.sink, layer].sum()) / args.obs_window, 3
                        ),
                        "best_digit_rank": ranks,
                    }
                )

            def kept(score):
                top = set(score.masked_fill(~cand, -1.0).topk(args.keep).indices.tolist())
                return sum(d in top for d in digits), top

            all_sum = probs.flatten(1).sum(1)
            k_all, top_all = kept(all_sum)
            k_up, _ = kept(probs[:, lo_l : hi_l + 1].flatten(1).sum(1))
            common = sorted(top_all, key=lambda i: -float(all_sum[i]))[:20]
            emit(
                {
                    "kind": "trial",
                    "trial": t.id,
                    "prompt_tokens": n,
                    "digits": len(digits),
                    "kept_all_layers": k_all,
                    f"kept_layers_{args.upper}": k_up,
                    "top_tokens_all_layers": [tok.decode([t.prompt[i]]) for i in common],
                }
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
