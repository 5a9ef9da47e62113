#!/usr/bin/env python
"""Collect K/V traces for KVP training: keys, values, positions and future attention mass.

    python scripts/collect_traces.py --model .cache/tiny-lm --out .cache/kvp/traces-train.pt
    python scripts/collect_traces.py --model .cache/tiny-lm --split heldout --out .cache/kvp/traces-heldout.pt
    python scripts/collect_traces.py --model .cache/smollm2 --text pydoc --heldout-every 4 \
        --num-seqs 24 --cut-every 64 --max-mb 400 --out .cache/kvp-smollm2/traces-train.pt

Runs a Hugging Face model (eager attention, full causal attention, fp32) over `--num-seqs`
seeded windows of `--seq-len` tokens of the text (default: the stdlib's .py files, split as in
`train_tiny_lm.py`; `--text pydoc` for Python's documentation prose, `--text FILE` for any
text) and writes one file in the format documented in `sgl_vtoken/kvp_train.py` (`Traces`):
keys and values in float16, the future attention mass of every token at cut points
`--min-cut, --min-cut + --cut-every, ...` up to `seq_len - horizon`, summed over the next
`--horizon` queries and over the query heads of each KV head. The file's size is estimated
first and refused above `--max-mb`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

from sgl_vtoken.kvp import ModelIdentity  # noqa: E402
from sgl_vtoken.kvp_train import Traces  # noqa: E402
from train_tiny_lm import corpus, tokenize  # noqa: E402


@torch.no_grad()
def hf_trace(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-attention trace of one sequence ``ids [T]``: keys and values ``[T, L, H, D]``
    (post-RoPE keys, as a KV cache holds them) and attention probabilities ``[L, H, T, T]``
    (query, key) summed over the query heads of each KV head."""
    res = model(ids[None], use_cache=True, output_attentions=True)
    cache = res.past_key_values
    keys = torch.stack([layer.keys[0] for layer in cache.layers]).permute(2, 0, 1, 3)
    values = torch.stack([layer.values[0] for layer in cache.layers]).permute(2, 0, 1, 3)
    hkv = model.config.num_key_value_heads
    probs = torch.stack([a[0].view(hkv, -1, *a.shape[-2:]).sum(1) for a in res.attentions])
    return keys.float(), values.float(), probs.float()


def future_mass(probs: torch.Tensor, cut: int, horizon: int) -> torch.Tensor:
    """``[T, L, H]`` attention mass each token j < cut receives from queries [cut, cut + horizon)."""
    m = probs[:, :, cut:cut + horizon].sum(2)                                    # [L, H, T]
    m[:, :, cut:] = 0.0
    return m.permute(2, 0, 1)


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def text_windows(model_path: str, text: str | None, split: str, num: int, seq_len: int,
                 seed: int, heldout_every: int = 10) -> torch.Tensor:
    """``[num, seq_len]`` seeded windows of the chosen split of the text."""
    from transformers import AutoTokenizer

    train_docs, held_docs = corpus(text, heldout_every)
    ids = tokenize(AutoTokenizer.from_pretrained(model_path), train_docs if split == "train" else held_docs)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num,), generator=gen).tolist()
    return torch.stack([ids[s:s + seq_len] for s in starts])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--out", required=True)
    p.add_argument("--text", default=None, help="'stdlib' (default), 'pydoc' or a plain-text file; see "
                   "train_tiny_lm.corpus")
    p.add_argument("--heldout-every", type=int, default=10, help="every N-th document is held out")
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--num-seqs", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--horizon", type=int, default=128)
    p.add_argument("--min-cut", type=int, default=32)
    p.add_argument("--cut-every", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-mb", type=float, default=256.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    identity = ModelIdentity.from_hf_config(model.config.to_dict())
    cuts = torch.arange(args.min_cut, args.seq_len - args.horizon + 1, args.cut_every)
    if cuts.numel() == 0:
        p.error(f"no cut point: --min-cut {args.min_cut} > --seq-len - --horizon")
    g = identity.num_layers * identity.num_kv_heads
    mb = args.num_seqs * args.seq_len * g * (2 * 2 * identity.head_dim + 4 * cuts.numel()) / 2**20
    if mb > args.max_mb:
        p.error(f"the traces would take {mb:.0f} MB > --max-mb {args.max_mb:.0f}; use fewer "
                "--num-seqs, a shorter --seq-len or a larger --cut-every")
    t0 = time.perf_counter()
    seqs = text_windows(args.model, args.text, args.split, args.num_seqs, args.seq_len, args.seed,
                        args.heldout_every)
    keys, values, targets = [], [], []
    for ids in seqs:
        k, v, probs = hf_trace(model, ids)
        keys.append(k.half())
        values.append(v.half())
        targets.append(torch.stack([future_mass(probs, int(c), args.horizon) for c in cuts]))
    tr = Traces(identity=identity, keys=torch.stack(keys), values=torch.stack(values),
                positions=torch.arange(args.seq_len), cuts=cuts, targets=torch.stack(targets),
                horizon=args.horizon, meta={"model": str(args.model), "split": args.split,
                                            "text": args.text or "stdlib", "seed": args.seed,
                                            "heldout_every": args.heldout_every})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tr.save(args.out)
    print(json.dumps({"event": "traces", "out": args.out, "split": args.split, "num_seqs": args.num_seqs,
                      "seq_len": args.seq_len, "cuts": cuts.tolist(), "horizon": args.horizon,
                      "mb": round(Path(args.out).stat().st_size / 2**20, 1),
                      "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
