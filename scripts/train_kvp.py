#!/usr/bin/env python
"""Train KVP scorers (one MLP per layer and KV head) on K/V traces; write a checkpoint.

    python scripts/train_kvp.py --traces .cache/kvp/traces-train.pt \\
        --heldout .cache/kvp/traces-heldout.pt --out .cache/kvp/kvp.safetensors

Objective: the ranking objective of arXiv:2602.10238 (Plackett-Luce rankings sampled by
Gumbel-sort, REINFORCE with a leave-one-out baseline, reward = minus the future attention mass
evicted summed over every budget, normalized between the oracle and the reverse ranking; see
`tools/sgl_vtoken_tools/kvp_train.py`). Seeded and CPU-deterministic: same traces and arguments,
same checkpoint bytes (the sha256 is printed). The checkpoint records the traced model's identity;
the server refuses it for another model. Prints JSON lines: progress every `--log-every` steps,
then the noise-free normalized reward (0 = oracle ranking, -1 = reverse, about -0.5 = random)
on the training and held-out traces, before and after training, and that of two per-head
heuristic rankings (recency, smallest key norm) on the held-out traces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

from sgl_vtoken.kvp import KVPScorer, save_checkpoint
from sgl_vtoken_tools.kvp_train import Traces, evaluate, fit_feature_stats, train


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", required=True, help="training traces (scripts/collect_traces.py)")
    p.add_argument("--heldout", default=None, help="held-out traces, for the reported reward")
    p.add_argument("--out", required=True, help="checkpoint path (.safetensors)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="rankings sampled per problem (K)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sink", type=int, default=4, help="tokens below this position are not ranked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm

    t0 = time.perf_counter()
    tr = Traces.load(args.traces)
    held = Traces.load(args.heldout) if args.heldout else None
    scorer = KVPScorer(tr.identity, hidden=args.hidden, seed=args.seed)
    fit_feature_stats(scorer, tr, args.sink)
    before = {
        "train": evaluate(scorer, tr, args.sink),
        "heldout": evaluate(scorer, held, args.sink) if held else None,
    }
    bar = tqdm(total=args.steps, desc="train kvp", file=sys.stderr, mininterval=2)
    window: list[float] = []

    def progress(step, rec):
        window.append(rec["reward"])
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.3f}", refresh=False)
        if (step + 1) % args.log_every == 0:
            print(
                json.dumps(
                    {
                        "event": "step",
                        "step": step + 1,
                        "reward": round(sum(window) / len(window), 4),
                        "elapsed_s": round(time.perf_counter() - t0, 1),
                    }
                ),
                flush=True,
            )
            window.clear()

    train(
        scorer,
        tr,
        args.steps,
        seed=args.seed,
        batch=args.batch,
        num_samples=args.samples,
        lr=args.lr,
        sink=args.sink,
        progress=progress,
    )
    bar.close()
    after = {
        "train": evaluate(scorer, tr, args.sink),
        "heldout": evaluate(scorer, held, args.sink) if held else None,
    }
    extra = {
        "traces": tr.meta,
        "horizon": tr.horizon,
        "steps": args.steps,
        "seed": args.seed,
        "sink": args.sink,
        "objective": "plackett-luce-reinforce-loo",
    }
    path = save_checkpoint(scorer, args.out, extra=extra)
    baselines = {
        h: evaluate(scorer, held or tr, args.sink, rank_by=h) for h in ("recency", "knorm")
    }
    print(
        json.dumps(
            {
                "event": "done",
                "out": str(path),
                "identity": vars(tr.identity),
                "reward_before": before,
                "reward_after": after,
                "heuristics_reward": {"traces": "heldout" if held else "train", **baselines},
                "steps": args.steps,
                "seed": args.seed,
                "train_s": round(time.perf_counter() - t0, 1),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
