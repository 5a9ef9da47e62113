"""Server start-up time and single-stream decode speed on this machine, as JSON lines.

Starts the tiny model (or `--model-path`) on CPU, records seconds until /health answers 200,
then times greedy `/generate` requests of `--new-tokens` tokens one at a time and reports the
median tokens/s. Example: `python scripts/bench_serving_basics.py --runs 5`.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import requests

from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args
from sgl_vtoken_tools.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--extra", default="", help="extra server flags, space separated")
    args = parser.parse_args()

    model = args.model_path or ensure_tiny_model(REPO / ".cache" / "tiny-llama")
    server_args = cpu_server_args(model, 4096, args.page_size) + args.extra.split()
    with ServerProcess(server_args) as server:
        print(
            json.dumps({"metric": "startup_seconds", "value": round(server.startup_seconds, 2)}),
            flush=True,
        )
        speeds = []
        for run in range(args.runs + 1):  # the first request warms up and is not counted
            payload = {
                "input_ids": list(range(10, 42)),
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": args.new_tokens,
                    "ignore_eos": True,
                },
            }
            t0 = time.perf_counter()
            r = requests.post(server.base_url + "/generate", json=payload, timeout=300)
            r.raise_for_status()
            if run:
                speeds.append(
                    r.json()["meta_info"]["completion_tokens"] / (time.perf_counter() - t0)
                )
        print(
            json.dumps(
                {
                    "metric": "single_stream_tokens_per_s",
                    "median": round(statistics.median(speeds), 1),
                    "runs": [round(s, 1) for s in speeds],
                    "new_tokens": args.new_tokens,
                    "page_size": args.page_size,
                    "extra": args.extra,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
