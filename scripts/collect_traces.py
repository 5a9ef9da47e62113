#!/usr/bin/env python
"""Collect K/V traces for KVP training: keys, values, positions and future attention mass.

    python scripts/collect_traces.py --model .cache/tiny-lm --out .cache/kvp/traces-train.pt
    python scripts/collect_traces.py --model .cache/tiny-lm --split heldout --out .cache/kvp/traces-heldout.pt
    python scripts/collect_traces.py --model .cache/smollm2 --text pydoc --heldout-every 4 \
        --num-seqs 24 --cut-every 64 --max-mb 400 --out .cache/kvp-smollm2/traces-train.pt

Runs a Hugging Face model (eager attention, full causal attention, fp32) over `--num-seqs`
seeded windows of `--seq-len` tokens of the text (`sgl_vtoken_tools.corpus`; default: the stdlib's
.py files; `--text pydoc` for Python's documentation prose, `--text FILE` for any text) and
writes one file in the format documented in `tools/sgl_vtoken_tools/kvp_train.py` (`Traces`):
keys and values in float16, the future attention mass of every token at cut points
`--min-cut, --min-cut + --cut-every, ...` up to `seq_len - horizon`, summed over the next
`--horizon` queries and over the query heads of each KV head. The file's size is estimated
first and refused above `--max-mb`. Prints one JSON line. The work is `sgl_vtoken_tools.kvp_traces`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sgl_vtoken.kvp import ModelIdentity
from sgl_vtoken_tools.corpus import text_windows
from sgl_vtoken_tools.hf_reference import load_model
from sgl_vtoken_tools.kvp_traces import collect, cut_points, trace_mb


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--text",
        default=None,
        help="'stdlib' (default), 'pydoc' or a plain-text file; see sgl_vtoken_tools.corpus",
    )
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
    cuts = cut_points(args.seq_len, args.horizon, args.min_cut, args.cut_every)
    if cuts.numel() == 0:
        p.error(f"no cut point: --min-cut {args.min_cut} > --seq-len - --horizon")
    mb = trace_mb(identity, args.num_seqs, args.seq_len, cuts.numel())
    if mb > args.max_mb:
        p.error(
            f"the traces would take {mb:.0f} MB > --max-mb {args.max_mb:.0f}; use fewer "
            "--num-seqs, a shorter --seq-len or a larger --cut-every"
        )
    t0 = time.perf_counter()
    seqs = text_windows(
        args.model,
        args.text,
        args.split,
        args.num_seqs,
        args.seq_len,
        args.seed,
        args.heldout_every,
    )
    tr = collect(
        model,
        seqs,
        cuts,
        args.horizon,
        meta={
            "model": str(args.model),
            "split": args.split,
            "text": args.text or "stdlib",
            "seed": args.seed,
            "heldout_every": args.heldout_every,
        },
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tr.save(args.out)
    print(
        json.dumps(
            {
                "event": "traces",
                "out": args.out,
                "split": args.split,
                "num_seqs": args.num_seqs,
                "seq_len": args.seq_len,
                "cuts": cuts.tolist(),
                "horizon": args.horizon,
                "mb": round(Path(args.out).stat().st_size / 2**20, 1),
                "elapsed_s": round(time.perf_counter() - t0, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
