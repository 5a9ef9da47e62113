"""Demo: serve the embedded tiny model on CPU with StreamingLLM eviction and hold a multi-turn chat.

Builds the tiny model (cached in .cache/tiny-llama), starts `python -m sglang.launch_server` on
127.0.0.1 with a capped KV pool and `--kv-evict streamingllm --kv-budget 64`, talks to it through
the OpenAI-compatible API, prints each reply with the token usage and how much KV the server
evicted and freed for it, and shuts the server down. The weights are random, so the replies are
gibberish; the mechanics are real.
"""

import argparse
import time
from pathlib import Path

import openai
import requests

from sgl_vtoken.launcher import ServerProcess, cpu_server_args
from sgl_vtoken.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = (
    "Hello! Can you summarise what a KV cache is?",
    "And why does memory run out before compute does?",
    "How would you decide which cached tokens to drop?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="model folder (default: the embedded tiny model)")
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool size in tokens")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per reply")
    parser.add_argument("--kv-evict", default="streamingllm", help="eviction policy ('none': stock)")
    parser.add_argument("--kv-budget", type=int, default=64, help="live KV tokens per request")
    args = parser.parse_args()

    model = args.model_path or ensure_tiny_model(REPO / ".cache" / "tiny-llama")
    server_args = cpu_server_args(model, args.max_total_tokens, args.page_size) + ["--enable-cache-report"]
    if args.kv_evict != "none":
        server_args += ["--kv-evict", args.kv_evict, "--kv-budget", str(args.kv_budget),
                        "--kv-evict-interval", str(args.page_size)]
    print(f"starting: python -m sglang.launch_server {' '.join(server_args)}", flush=True)
    with ServerProcess(server_args) as server:
        print(f"server ready at {server.base_url} after {server.startup_seconds:.1f} s\n", flush=True)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        messages = [{"role": "system", "content": "You are a helpful assistant for serving engineers."}]
        before = vtoken_counters(server.base_url) if args.kv_evict != "none" else {}
        for turn, question in enumerate(QUESTIONS, 1):
            messages.append({"role": "user", "content": question})
            t0 = time.monotonic()
            reply = client.chat.completions.create(model="default", messages=messages,
                                                   max_tokens=args.max_tokens, temperature=0)
            dt = time.monotonic() - t0
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            usage = reply.usage
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            print(f"[turn {turn}] user: {question}")
            print(f"[turn {turn}] assistant: {text!r}")
            print(f"[turn {turn}] usage: prompt={usage.prompt_tokens} cached={cached} "
                  f"completion={usage.completion_tokens} ({usage.completion_tokens / dt:.0f} tok/s)", flush=True)
            if args.kv_evict != "none":
                now = vtoken_counters(server.base_url)
                evicted = now["evicted_tokens"] - before.get("evicted_tokens", 0)
                freed = now["pages_freed"] - before.get("pages_freed", 0)
                total = usage.prompt_tokens + usage.completion_tokens
                print(f"[turn {turn}] KV: kept at most {args.kv_budget} of {total} tokens; evicted {evicted}, "
                      f"freed {freed} pages ({freed * args.page_size * now['bytes_per_token'] / 1024:.0f} KiB)",
                      flush=True)
                before = now
            print(flush=True)
    print("server stopped")


def vtoken_counters(base_url: str) -> dict:
    info = requests.get(base_url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0]["vtoken"]


if __name__ == "__main__":
    main()
