"""Cost of each eviction policy per decode step, side by side in one server, as JSON lines.

One CPU server (`--kv-evict none`; each request picks its policy through `custom_params.kv_evict`)
runs, for every policy in turn, `--batch` concurrent greedy requests of `--new-tokens` tokens
with the same budget, window and interval, and reports the best (and median) wall time per decode
step over the rounds (the batch advances one token per step; rounds interleave the policies) and the difference to
`streamingllm`, whose eviction needs no statistics. With `--decode-only` each round also times the
same batch with one new token and subtracts it, so a slow prefill (a real model on CPU) does
not count. The attention policies add the recomputation of attention probabilities next to
every layer; `knorm` gathers the cached keys. Example:

    python -m sgl_vtoken_tools policy-overhead --runs 3
"""

import json
import statistics
import sys
import threading
import time

import requests

from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args
from sgl_vtoken_tools.tiny_model import ensure_tiny_model

POLICIES = ("none", "streamingllm", "random", "knorm", "h2o", "tova", "scissorhands")


def run_batch(base_url: str, policy: str, args, run: int, new_tokens: int | None = None) -> float:
    """Seconds to prefill and decode `new_tokens` (default `args.new_tokens`) tokens for
    `args.batch` concurrent requests."""
    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    kv = (
        None
        if policy == "none"
        else {"policy": policy, "budget": args.budget, "window": args.window}
    )
    errors = []

    def one(i):
        params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
        if kv:
            params["custom_params"] = {"kv_evict": kv}
        r = requests.post(
            base_url + "/generate",
            timeout=600,
            json={
                "rid": f"{policy}-{run}-{i}",
                "input_ids": [10 + (i * 37 + j) % 1900 for j in range(args.prompt)],
                "sampling_params": params,
            },
        )
        if r.status_code != 200 or len(r.json()["output_ids"]) != new_tokens:
            errors.append(r.text[:200])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.batch)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{policy}: {errors[0]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, __name__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3, help="median of this many runs per policy")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="also time each round's batch with 1 new token (prefill) and report "
        "(T(new_tokens) - T(1)) / (new_tokens - 1): for models whose prefill is not negligible",
    )
    args = parser.parse_args(argv)
    if args.decode_only and args.new_tokens < 2:
        parser.error("--decode-only needs --new-tokens >= 2")

    model = args.model_path or ensure_tiny_model(REPO / ".cache" / "tiny-llama")
    server_args = cpu_server_args(model, 4096, args.page_size) + ["--dtype", "float32"]
    policies = args.policies.split(",")
    times = {p: [] for p in policies}
    with ServerProcess(server_args) as server:
        for policy in policies:  # warm-up: every code path once
            run_batch(server.base_url, policy, args, -1)
        # Rounds interleave the policies, so drift in machine load hits all of them alike.
        for r in range(args.runs):
            for policy in policies:
                t = run_batch(server.base_url, policy, args, r)
                if args.decode_only:
                    t -= run_batch(server.base_url, policy, args, r + args.runs, new_tokens=1)
                times[policy].append(t)
            print(f"round {r + 1}/{args.runs} done", file=sys.stderr, flush=True)
    # Best of the rounds is the headline: on a shared machine other load only ever adds time.
    steps = args.new_tokens - 1 if args.decode_only else args.new_tokens
    per_step = {p: min(t) / steps * 1e3 for p, t in times.items()}
    base = per_step.get("streamingllm")
    for policy in policies:
        print(
            json.dumps(
                {
                    "metric": "decode_step_ms",
                    "policy": policy,
                    "ms_per_step": round(per_step[policy], 3),
                    "median_ms_per_step": round(statistics.median(times[policy]) / steps * 1e3, 3),
                    "vs_streamingllm_ms": None
                    if base is None
                    else round(per_step[policy] - base, 3),
                    "tokens_per_s": round(args.batch * 1e3 / per_step[policy], 1),
                    "batch": args.batch,
                    "budget": args.budget,
                    "window": args.window,
                    "interval": 1,
                    "page_size": args.page_size,
                    "prompt": args.prompt,
                    "new_tokens": args.new_tokens,
                    "decode_only": args.decode_only,
                    "model": str(model),
                    "runs_ms_per_step": [round(t / steps * 1e3, 2) for t in times[policy]],
                }
            ),
            flush=True,
        )
