#!/usr/bin/env python
"""The fast masked reference against the full-recompute oracle on any model, every policy.

    python scripts/check_fastref.py --model .cache/smollm2 --out docs/results/fastref_smollm2.jsonl

For each policy and (page size, interval), greedy tokens of `sgl_vtoken_tools.quality.fastref`
(incremental, compacted KV cache) and of `sgl_vtoken_tools.hf_reference.masked_greedy` (the whole
sequence recomputed with a 4-D mask at every step) on a seeded prompt of essay text, in fp32.
One JSON line per case: equal, first differing index, both wall times. `kvp` uses an untrained
scorer built for the model (exactness needs the same scorer on both sides, not a good one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from sgl_vtoken_tools.quality.cli import add_model_flags, json_lines, load

POLICIES = ["streamingllm", "random", "knorm", "h2o", "tova", "scissorhands", "kvp"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(p)
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--cases", nargs="+", default=["16:16", "1:1"], help="page_size:interval")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--window", type=int, default=16)
    args = p.parse_args(argv)

    tok, fast = load(args.model, args.threads)
    from sgl_vtoken.config import EvictConfig
    from sgl_vtoken.kvp import KVPScorer, ModelIdentity, save_checkpoint
    from sgl_vtoken.units import Words
    from sgl_vtoken_tools import hf_reference
    from sgl_vtoken_tools.quality import data
    from sgl_vtoken_tools.quality.fastref import fast_greedy
    from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy

    eager = hf_reference.load_model(args.model)
    words = Words.from_tokenizer(tok)  # the attention policies keep words whole (span 8)
    ids = tok(data.heldout_texts()[0], add_special_tokens=False)["input_ids"]
    idt = ModelIdentity.from_hf_config(eager.config.to_dict())
    kvp = str(
        save_checkpoint(
            KVPScorer(idt, hidden=8, seed=0), Path(tempfile.mkdtemp()) / "kvp.safetensors"
        )
    )
    ok = True
    with json_lines(args.out) as emit:
        for case in args.cases:
            page, interval = map(int, case.split(":"))
            for k, policy in enumerate(args.policies):
                prompt = ids[k * 50 : k * 50 + args.prompt_tokens]
                cfg = EvictConfig(
                    policy=policy,
                    budget=args.budget,
                    sink=4,
                    page_size=page,
                    interval=interval,
                    window=args.window if policy in ("h2o", "scissorhands", "knorm") else 0,
                    params={"checkpoint": kvp} if policy == "kvp" else {},
                )
                t0 = time.monotonic()
                a, _ = hf_reference.masked_greedy(
                    eager,
                    prompt,
                    args.new_tokens,
                    cfg,
                    rid=f"check-{policy}",
                    policy=runtime_policy,
                    recall=RUNTIME_RECALL,
                )
                t1 = time.monotonic()
                b, _ = fast_greedy(
                    fast, prompt, args.new_tokens, cfg, rid=f"check-{policy}", words=words
                )
                t2 = time.monotonic()
                diff = (
                    None
                    if a == b
                    else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                )
                ok &= a == b
                emit(
                    {
                        "kind": "fastref_check",
                        "policy": policy,
                        "page_size": page,
                        "interval": interval,
                        "prompt_tokens": len(prompt),
                        "new_tokens": len(a),
                        "budget": args.budget,
                        "equal": a == b,
                        "first_diff": diff,
                        "oracle_seconds": round(t1 - t0, 2),
                        "fast_seconds": round(t2 - t1, 2),
                    }
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
