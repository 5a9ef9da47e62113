#!/usr/bin/env python
"""Quality under KV eviction, measured through the server: needle retrieval, greedy agreement, perplexity.

    python scripts/eval_quality.py --model-path meta-llama/Llama-3.1-8B-Instruct \\
        --policies streamingllm random knorm --budgets 256 512 1024 --out quality.jsonl
    python scripts/eval_quality.py --base-url http://127.0.0.1:30000 --budgets 128
    python scripts/eval_quality.py --cpu --smoke        # tiny model on CPU: mechanics only

Everything goes through the HTTP API, so it measures what users of the server get; each
(policy, budget) travels with the request as `custom_params.kv_evict` (sgl-vtoken's per-request
override), `{"policy": "none"}` is the full-attention baseline on the same server.

What eviction can and cannot change. The server prefills a prompt whole and evicts only before
decode steps (a row that reached `budget + interval` tokens is cut to `budget`). So:

1. **Needle retrieval** (under eviction). RULER-style NIAH with a locally generated "noise"
   haystack ("The grass is green. The sky is blue. ..."), one needle "One of the special magic
   numbers for <key> is: <7-digit number>." at each of `--depths` of each `--haystack-tokens`
   length, and a question asking the model to answer with a full sentence ("The special magic
   number for <key> is <number>."), so the number is written after several generated tokens,
   i.e. under eviction once the prompt exceeds `budget + interval`. Only the first generated token
   comes from the prefill's full attention. Score: the number appears in the greedy answer
   (chat completions, `--needle-max-tokens`).
2. **Greedy agreement** (under eviction). `--agree-prompts` windows of `--agree-prompt-tokens`
   tokens of the text, each continued greedily for `--agree-tokens` tokens with and without
   eviction (`/generate` on token ids); reported: the mean fraction of positions where the two
   continuations agree, and the mean length of the common prefix. Equal to 1.0 / the full length
   when eviction changes nothing.
3. **Perplexity** (no eviction: the baseline only). Teacher-forced NLL of `--ppl-tokens` tokens of
   the text in windows of `--ppl-window` tokens, from the prefill's `input_token_logprobs`
   (`/generate` with `return_logprob`, `logprob_start_len: 0`, `max_new_tokens: 1`). Perplexity
   *under eviction* cannot be measured honestly through this server: teacher forcing is a
   prefill, and prefills are never evicted; decode-time logprobs exist only for tokens the model
   itself picked (SGLang's grammar and logit-processor masks apply before the logprobs, so
   forcing the reference tokens would report the masked distribution). The agreement figures are
   the decode-time substitute.

The text is `--text FILE` (plain text), by default the English prose of the Python reference
documentation that ships with Python (`pydoc_data.topics`), so nothing is downloaded. With the
tiny random-weight model the numbers are meaningless (the mechanics are real); with a real model
they are the quality side of the `--kv-budget` trade-off.

Server: `--base-url` (any running sgl-vtoken server; the interval, sinks and reclaim mode are
the server's: with a server-wide `--kv-evict none` per-request eviction runs at interval 1), or
`--model-path` to start one (`--kv-evict <first policy> --kv-budget <first budget>
--kv-evict-interval I --page-size P --max-total-tokens POOL` plus `--server-args`; `--cpu` adds
the CPU flags and float32).

Output: JSON lines (`--out`, default stdout): one `needle` / `agree` line per trial, one `ppl`
line, and one `summary` line per setting; a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import signal
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
KEYS = ("wandering-harbor", "silent-meadow", "copper-lantern", "hidden-orchard", "velvet-canyon",
        "amber-falcon", "frozen-river", "crimson-tower", "gentle-thunder", "ivory-compass")


class Server:
    def __init__(self, base_url: str, model: str | None = None, timeout: float = 600.0):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        if model is None:
            data = requests.get(self.base_url + "/v1/models", timeout=30).json()
            model = data["data"][0]["id"]
        self.model = model

    def post(self, path: str, payload: dict) -> dict:
        r = requests.post(self.base_url + path, json=payload, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def tokenize(self, text: str) -> list[int]:
        return self.post("/v1/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})["tokens"]

    def count(self, text: str) -> int:
        return len(self.tokenize(text))

    def vtoken_state(self) -> dict | None:
        for path in ("/server_info", "/get_server_info"):
            try:
                r = requests.get(self.base_url + path, timeout=30)
                if r.status_code == 200:
                    return r.json()["internal_states"][0].get("vtoken")
            except (requests.RequestException, KeyError, IndexError, ValueError):
                continue
        return None


def load_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    from pydoc_data.topics import topics  # English prose that ships with Python
    return "\n\n".join(topics[k] for k in sorted(topics))


def settings(args) -> list[dict]:
    """The evaluated settings: the full-attention baseline first, then policy x budget."""
    out = [{"policy": "none"}]
    out += [{"policy": p, "budget": b} for p in args.policies for b in args.budgets]
    return out


def name(setting: dict) -> str:
    return "none" if setting["policy"] == "none" else f"{setting['policy']}-{setting['budget']}"


# ----------------------------------------------------------------------------- needle


def needle_prompts(server: Server, args) -> list[dict]:
    """Haystacks of about `length` tokens with one needle at each depth, seeded."""
    rng = random.Random(args.seed)
    unit = server.count(NOISE)
    out = []
    for length in args.haystack_tokens:
        for depth in args.depths:
            for rep in range(args.needles):
                key = KEYS[rng.randrange(len(KEYS))] + f"-{rng.randrange(100)}"
                value = str(rng.randrange(1_000_000, 10_000_000))
                needle = f"One of the special magic numbers for {key} is: {value}. "
                n_units = max(1, round(length / unit))
                at = round(depth * n_units)
                hay = NOISE * at + needle + NOISE * (n_units - at)
                question = (f"What is the special magic number for {key} mentioned in the provided text? "
                            f"Answer with one sentence of the form: The special magic number for {key} is <number>.")
                messages = [{"role": "user", "content":
                             "Some special magic numbers are hidden within the following text. Make sure to "
                             f"memorize them. I will quiz you about the numbers afterwards.\n{hay}\n{question}"}]
                out.append({"length": length, "depth": depth, "rep": rep, "key": key, "value": value,
                            "messages": messages})
    return out


def run_needle(server: Server, args, setting: dict, prompts: list[dict], emit) -> dict:
    hits = 0
    for p in prompts:
        payload = {"model": server.model, "messages": p["messages"], "max_tokens": args.needle_max_tokens,
                   "temperature": 0.0, "custom_params": {"kv_evict": setting}}
        r = server.post("/v1/chat/completions", payload)
        text = r["choices"][0]["message"]["content"] or ""
        hit = p["value"] in text
        hits += hit
        emit({"kind": "needle", "setting": name(setting), "length": p["length"], "depth": p["depth"],
              "rep": p["rep"], "prompt_tokens": r["usage"]["prompt_tokens"], "hit": hit, "answer": text[:200]})
    return {"needle_accuracy": round(hits / len(prompts), 4) if prompts else None, "needle_trials": len(prompts)}


# ----------------------------------------------------------------------------- agreement, ppl


def generate_ids(server: Server, ids: list[int], n: int, setting: dict | None, **extra) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
    if setting is not None:
        params["custom_params"] = {"kv_evict": setting}
    return server.post("/generate", {"input_ids": ids, "sampling_params": params, **extra})


def agree_windows(tokens: list[int], args) -> list[list[int]]:
    rng = random.Random(args.seed + 1)
    span = args.agree_prompt_tokens
    if len(tokens) < span + 1:
        raise SystemExit(f"--text has {len(tokens)} tokens, fewer than --agree-prompt-tokens {span}")
    starts = sorted(rng.randrange(0, len(tokens) - span) for _ in range(args.agree_prompts))
    return [tokens[s: s + span] for s in starts]


def run_agreement(server: Server, args, setting: dict, windows, reference, emit) -> dict:
    fracs, prefixes = [], []
    for i, (ids, ref) in enumerate(zip(windows, reference)):
        out = generate_ids(server, ids, args.agree_tokens, setting)["output_ids"]
        same = [a == b for a, b in zip(out, ref)]
        prefix = next((k for k, s in enumerate(same) if not s), len(same))
        fracs.append(sum(same) / max(1, len(ref)))
        prefixes.append(prefix)
        emit({"kind": "agree", "setting": name(setting), "window": i, "agreement": round(fracs[-1], 4),
              "common_prefix": prefix, "tokens": len(ref)})
    return {"agreement": round(sum(fracs) / len(fracs), 4) if fracs else None,
            "common_prefix": round(sum(prefixes) / len(prefixes), 1) if prefixes else None}


def run_ppl(server: Server, args, tokens: list[int], emit) -> dict:
    """Teacher-forced perplexity without eviction from the prefill's input logprobs."""
    nll, n = 0.0, 0
    tokens = tokens[: args.ppl_tokens]
    for start in range(0, len(tokens) - 1, args.ppl_window):
        window = tokens[start: start + args.ppl_window]
        if len(window) < 2:
            break
        r = generate_ids(server, window, 1, {"policy": "none"}, return_logprob=True, logprob_start_len=0)
        lps = r["meta_info"]["input_token_logprobs"]
        # One entry per input token; the first has no prediction (None).
        vals = [lp[0] for lp in lps if lp[0] is not None]
        if len(vals) != len(window) - 1:
            raise RuntimeError(f"expected {len(window) - 1} input logprobs, got {len(vals)}")
        nll -= sum(vals)
        n += len(vals)
    ppl = math.exp(nll / n) if n else None
    rec = {"kind": "ppl", "setting": "none", "tokens": n, "window": args.ppl_window,
           "nll_per_token": round(nll / n, 5) if n else None, "ppl": round(ppl, 4) if ppl else None}
    emit(rec)
    return rec


# ----------------------------------------------------------------------------- main


def evaluate(server: Server, args, emit) -> list[dict]:
    text = load_text(args.text)
    # Tokenize a prefix of the text that is certainly long enough (about 1 token per 2 characters).
    need = max(args.ppl_tokens, args.agree_prompt_tokens * 2) * 8
    tokens = server.tokenize(text[:need])
    state0 = server.vtoken_state()
    results = []
    ppl = run_ppl(server, args, tokens, emit) if args.ppl_tokens > 1 else None
    prompts = needle_prompts(server, args)
    windows = agree_windows(tokens, args) if args.agree_prompts else []
    reference = [generate_ids(server, w, args.agree_tokens, {"policy": "none"})["output_ids"] for w in windows]
    for setting in settings(args):
        t0 = time.monotonic()
        row = {"kind": "summary", "setting": name(setting), **setting}
        row.update(run_needle(server, args, setting, prompts, emit))
        row.update(run_agreement(server, args, setting, windows, reference, emit))
        row["ppl_no_eviction"] = ppl["ppl"] if ppl else None
        row["seconds"] = round(time.monotonic() - t0, 1)
        emit(row)
        results.append(row)
    state1 = server.vtoken_state()
    if state0 is not None and state1 is not None:
        emit({"kind": "server", "evicted_tokens": state1["evicted_tokens"] - state0["evicted_tokens"],
              "evictions": state1["evictions"] - state0["evictions"], "config": state1.get("config")})
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--base-url", help="a running server")
    src.add_argument("--model-path", help="start a server for this model (default with --cpu: the tiny model)")
    p.add_argument("--cpu", action="store_true", help="start the server on CPU (torch-native attention, float32)")
    p.add_argument("--server-args", default="", help="extra flags for the server this script starts")
    p.add_argument("--pool", type=int, default=16384, help="--max-total-tokens of the started server")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--interval", type=int, default=16, help="--kv-evict-interval of the started server")
    p.add_argument("--policies", nargs="+", default=["streamingllm", "random", "knorm"])
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--haystack-tokens", type=int, nargs="+", default=[2000, 4000])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--needles", type=int, default=2, help="needles per (length, depth)")
    p.add_argument("--needle-max-tokens", type=int, default=48)
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-prompt-tokens", type=int, default=1024)
    p.add_argument("--agree-tokens", type=int, default=128)
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--ppl-window", type=int, default=1024)
    p.add_argument("--text", default=None, help="plain-text file (default: pydoc_data.topics)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes for a mechanics check")
    p.add_argument("--out", default=None, help="JSON lines file (default: stdout)")
    return p


def apply_smoke(args) -> None:
    args.budgets = [b for b in args.budgets if b <= 64] or [64]
    args.policies = args.policies[:2]
    args.haystack_tokens, args.depths, args.needles, args.needle_max_tokens = [300], [0.5], 1, 24
    args.agree_prompts, args.agree_prompt_tokens, args.agree_tokens = 1, 200, 24
    args.ppl_tokens, args.ppl_window = 256, 128


def print_table(results: list[dict], stream=sys.stderr) -> None:
    print(f"{'setting':>22} {'needle acc':>10} {'agreement':>10} {'common prefix':>14} {'ppl (no evict)':>15}", file=stream)
    for r in results:
        print(f"{r['setting']:>22} {str(r['needle_accuracy']):>10} {str(r['agreement']):>10} "
              f"{str(r['common_prefix']):>14} {str(r['ppl_no_eviction']):>15}", file=stream)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server gets stopped
    if args.smoke:
        apply_smoke(args)
    out = open(args.out, "w") if args.out else sys.stdout

    def emit(rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()

    try:
        if args.base_url:
            results = evaluate(Server(args.base_url), args, emit)
        else:
            sys.path.insert(0, str(REPO))
            from sgl_vtoken.launcher import ServerProcess, cpu_server_args
            model = args.model_path
            if model is None:
                if not args.cpu:
                    raise SystemExit("give --base-url, --model-path, or --cpu for the tiny model")
                from sgl_vtoken.tiny_model import ensure_tiny_model
                model = str(ensure_tiny_model(REPO / ".cache" / "tiny-llama"))
            flags = (cpu_server_args(model, args.pool, args.page_size) + ["--dtype", "float32"] if args.cpu else
                     ["--model-path", model, "--max-total-tokens", str(args.pool), "--page-size", str(args.page_size)])
            flags += ["--kv-evict", args.policies[0], "--kv-budget", str(args.budgets[0]),
                      "--kv-evict-interval", str(args.interval), *shlex.split(args.server_args)]
            with ServerProcess(flags) as server:
                results = evaluate(Server(server.base_url), args, emit)
    finally:
        if out is not sys.stdout:
            out.close()
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
