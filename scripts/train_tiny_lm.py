#!/usr/bin/env python
"""Train the tiny Llama on text that ships with Python, so that its attention means something.

    python scripts/train_tiny_lm.py --out .cache/tiny-lm            # ~5 min on 2 cores
    python scripts/train_tiny_lm.py --text my.txt --steps 3000 --layers 4

The architecture and tokenizer are `sgl_vtoken_tools.tiny_model`'s (Llama, hidden 128, 4 query / 2 KV
heads, byte-level BPE); only the layer count is an argument. Text (`sgl_vtoken_tools.corpus`): the
top-level modules of the standard library (`*.py`, sorted by name), every `--heldout-every`-th
file held out; `--text pydoc` for Python's documentation topics; or the `--text` file, whose
last 10% is held out. Seeded: same arguments, same weights. The result is a Hugging Face model
folder (SGLang serves it like the random-weight one). Prints JSON lines: progress every
`--log-every` steps, then the held-out perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from sgl_vtoken_tools.corpus import corpus, tokenize
from sgl_vtoken_tools.tiny_model import TinyModelSpec, build_tiny_model

REPO = Path(__file__).resolve().parent.parent


def windows(ids: torch.Tensor, seq_len: int, num: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - seq_len - 1, (num,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Teacher-forced perplexity over consecutive non-overlapping windows of held-out tokens."""
    nll, count = 0.0, 0
    for w in range(min(max_windows, ids.numel() // seq_len)):
        x = ids[w * seq_len : (w + 1) * seq_len][None]
        loss = model(x, labels=x).loss
        nll += float(loss) * (seq_len - 1)
        count += seq_len - 1
    return math.exp(nll / count)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / ".cache" / "tiny-lm"), help="model folder to write")
    p.add_argument(
        "--text",
        default=None,
        help="'stdlib' (the default: the stdlib's .py files), 'pydoc' "
        "(Python's documentation topics) or a plain-text file",
    )
    p.add_argument("--heldout-every", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--log-every", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_model(
        args.out,
        TinyModelSpec(num_hidden_layers=args.layers, seed=args.seed, initializer_range=0.02),
    )
    tok = AutoTokenizer.from_pretrained(out)
    train_docs, held_docs = corpus(args.text, args.heldout_every)
    train_ids, held_ids = tokenize(tok, train_docs), tokenize(tok, held_docs)
    print(
        json.dumps(
            {"event": "data", "train_tokens": train_ids.numel(), "heldout_tokens": held_ids.numel()}
        ),
        flush=True,
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / warm)
            * 0.5
            * (1 + math.cos(math.pi * min(i, args.steps) / args.steps))
        ),
    )
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc="train tiny LM", file=sys.stderr, mininterval=5)
    for step in bar:
        x = windows(train_ids, args.seq_len, args.batch, gen)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
        if (step + 1) % args.log_every == 0:
            print(
                json.dumps(
                    {
                        "event": "step",
                        "step": step + 1,
                        "loss": round(float(loss), 4),
                        "elapsed_s": round(time.perf_counter() - t0, 1),
                    }
                ),
                flush=True,
            )
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    ppl = perplexity(model, held_ids, args.seq_len, args.eval_windows)
    ppl_train = perplexity(model, train_ids, args.seq_len, args.eval_windows)
    result = {
        "event": "done",
        "out": str(out),
        "layers": args.layers,
        "steps": args.steps,
        "seed": args.seed,
        "heldout_ppl": round(ppl, 3),
        "train_ppl": round(ppl_train, 3),
        "train_s": round(time.perf_counter() - t0, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    (Path(out) / "train_result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
