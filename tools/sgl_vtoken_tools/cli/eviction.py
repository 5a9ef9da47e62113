"""Server eviction on CPU with the tiny model: capacity under a small KV pool, and what the plugin costs when off.

Prints one JSON line per configuration or measurement to stdout; progress goes to stderr.

    python -m sgl_vtoken_tools eviction                      # both parts (several minutes on 2 cores)
    python -m sgl_vtoken_tools eviction --part capacity      # or: --part overhead
    python -m sgl_vtoken_tools eviction --quick              # smoke run: fewer tokens and runs

capacity: 16 concurrent requests x 1024 generated tokens (48-token seeded random prompts, greedy,
`ignore_eos`) under `--max-total-tokens 4096 --page-size 16`, in one run: stock SGLang
(`--kv-evict none`) and `--kv-evict streamingllm --kv-budget 128` at each `--intervals` value.
Peak running requests come from the server log ("Decode batch, #running-req: N", logged every
decode step here) and, with eviction on, also from the plugin's counter in `/get_server_info`;
retractions are the log lines "KV cache pool is full. Retract requests.".

overhead: single-stream decode tokens/s (median of `--runs` requests after a warm-up) of
`--kv-evict none` with the plugin installed vs SGLang without the plugin. The baseline server
runs with `SGLANG_PLUGINS` listing every other installed general plugin (SGLang's whitelist; so
only sgl-vtoken differs; `--baseline-plugins none` gives `__none__`, no plugin at all) plus a
`sitecustomize.py`, written to a temporary directory on `PYTHONPATH`, that applies only the one
CPU fix the plugin also makes (`rotary_embedding.base._is_cpu = True`, see patches/cpu.py):
without it SGLang cannot load a model on CPU at all. The shim prints one line per process it
patched; the JSON reports that count and whether the plugin left its trace in each log.

Every server runs with OMP_NUM_THREADS=1 (`--server-threads`): on a shared 2-core machine two
OpenMP threads spin-wait on each other whenever one is descheduled, which made identical runs
differ 20x in tokens/s. The tiny model gains nothing from a second intra-op thread.

The servers import the plugin from wherever `sgl_vtoken` resolves (the first JSON line, "meta",
says where): with the editable install that is the working tree at server start.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from sgl_vtoken_tools.bench import machine, plugin_overhead
from sgl_vtoken_tools.bench.baseline import (
    group_cpu_seconds,
    thread_env,
)
from sgl_vtoken_tools.bench.http_client import generate
from sgl_vtoken_tools.bench.load import random_ids, run_load
from sgl_vtoken_tools.bench.machine import loadavg
from sgl_vtoken_tools.bench.probe import wait_pool_free
from sgl_vtoken_tools.bench.server_log import (
    count_retractions,
    error_lines,
    peak_running_from_log,
    retracted_requests,
)
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO

# ---------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[bench_eviction {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def wait_for_quiet(max_load: float | None, timeout: float) -> None:
    machine.wait_for_quiet(max_load, timeout, say=log)


# ---------------------------------------------------------------------------------------------
# Part 1: capacity


def capacity(args, model: Path, log_dir: Path) -> None:
    from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args, evict_args

    base = cpu_server_args(model, args.max_total_tokens, args.page_size) + [
        "--dtype",
        "float32",
        "--decode-log-interval",
        str(args.decode_log_interval),
    ]
    configs = [("stock", ["--kv-evict", "none"])]
    for interval in args.intervals:
        name = f"streamingllm-b{args.budget}-i{interval}"
        configs.append((name, evict_args("streamingllm", args.budget, interval)))

    for name, extra in configs:
        log_path = log_dir / f"capacity-{name}.log"
        wait_for_quiet(args.wait_load, args.wait_load_timeout)
        log(f"capacity {name}: starting server (log {log_path})")
        with ServerProcess(
            base + extra,
            env=thread_env(args),
            log_path=log_path,
            startup_timeout=args.startup_timeout,
        ) as server:
            generate(
                server.base_url, random_ids(args.prompt_len, seed=10_000), 16, args.request_timeout
            )  # warm-up
            load_avg_before = loadavg()
            log(f"capacity {name}: {args.requests} requests x {args.new_tokens} tokens")
            cpu0 = group_cpu_seconds(server.proc.pid)
            load = run_load(
                server.base_url,
                args.requests,
                args.prompt_len,
                args.new_tokens,
                args.request_timeout,
            )
            cpu = group_cpu_seconds(server.proc.pid) - cpu0
            evicting = extra[1] != "none"
            state = wait_pool_free(server.base_url) if evicting else None
            time.sleep(0.5)  # let the scheduler's last log records reach the file
            text = server.log_text()
            startup = server.startup_seconds
        peak_log = peak_running_from_log(text)
        record = {
            "part": "capacity",
            "config": name,
            "flags": extra,
            "requests": args.requests,
            "prompt_tokens": args.prompt_len,
            "new_tokens": args.new_tokens,
            "max_total_tokens": args.max_total_tokens,
            "page_size": args.page_size,
            "decode_log_interval": args.decode_log_interval,
            **load,
            "server_cpu_s": round(cpu, 2),
            "output_tokens_per_cpu_s": round(load["output_tokens"] / cpu, 1) if cpu > 0 else None,
            "peak_running_requests_log": peak_log,
            "retractions": count_retractions(text),
            "retracted_requests": retracted_requests(text),
            "startup_s": round(startup, 1) if startup else None,
            "loadavg_1m_before": load_avg_before,
            "log": str(log_path),
            "log_errors": error_lines(text),
        }
        if state is not None:
            counter = state["peak_running_requests"]
            record.update(
                {
                    "peak_running_requests_counter": counter,
                    "peak_running_agree": counter == peak_log
                    if args.decode_log_interval == 1
                    else None,
                    "pool_whole_after": state["pool_available_tokens"]
                    + state["pool_evictable_tokens"]
                    == state["pool_total_tokens"],
                    "vtoken": {k: v for k, v in state.items() if k != "config"},
                }
            )
        emit(record)
        log(
            f"capacity {name}: peak running {peak_log}, {record['retractions']} retractions, "
            f"{record['output_tokens_per_s']} tok/s, {record['wall_s']} s"
        )


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = common.parser(__doc__, __name__)
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--part", choices=("capacity", "overhead", "all"), default="all")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: capacity 512 tokens and interval 16 only; overhead 64 tokens x 2 runs, 1 round",
    )
    p.add_argument(
        "--model-path", default=None, help="default: the tiny model, built into .cache/tiny-llama"
    )
    common.numbers(p, max_total_tokens=4096, page_size=16, prompt_len=48)
    p.add_argument("--requests", type=int, default=16, help="capacity: concurrent requests")
    p.add_argument(
        "--new-tokens", type=int, default=1024, help="capacity: generated tokens per request"
    )
    p.add_argument("--budget", type=int, default=128, help="capacity: --kv-budget")
    p.add_argument(
        "--intervals", default="16,1", help="capacity: --kv-evict-interval values, comma-separated"
    )
    p.add_argument(
        "--decode-log-interval",
        type=int,
        default=1,
        help="capacity: SGLang's --decode-log-interval (1 = every step, exact peak from the log)",
    )
    p.add_argument("--runs", type=int, default=5, help="overhead: timed requests per server")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="overhead: server pairs, order alternating (baseline, plugin, plugin, baseline, ...)",
    )
    p.add_argument(
        "--baseline-plugins",
        choices=("others", "none"),
        default="others",
        help="overhead baseline: load every other installed SGLang general plugin (only "
        "sgl-vtoken differs) or none (SGLANG_PLUGINS=__none__)",
    )
    p.add_argument(
        "--overhead-tokens", type=int, default=256, help="overhead: generated tokens per request"
    )
    p.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for every server (0: unset, torch uses every core). 1 because on a "
        "shared machine OpenMP threads spin-wait on descheduled peers: with 2 threads under "
        "load, server CPU per token rose ~10x and tok/s varied 20x between identical runs",
    )
    common.numbers(p, request_timeout=600.0, startup_timeout=240.0)
    p.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="before each server start, wait until the 1-minute load average is below this",
    )
    p.add_argument(
        "--wait-load-timeout", type=float, default=600.0, help="longest wait for --wait-load, s"
    )
    p.add_argument(
        "--log-dir", default=None, help="where server logs go (default: a new temporary directory)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.new_tokens = min(args.new_tokens, 512)
        args.intervals = "16"
        args.runs = min(args.runs, 2)
        args.rounds = 1
        args.overhead_tokens = min(args.overhead_tokens, 64)
    args.intervals = [int(x) for x in str(args.intervals).split(",") if x.strip()]
    if args.requests < 1 or args.requests > 256 or args.runs < 1 or args.rounds < 1:
        p.error("--requests must be 1..256, --runs and --rounds >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from sgl_vtoken_tools.bench.cell_server import resolve_model

    model = Path(args.model_path or resolve_model("tiny"))
    log_dir = (
        Path(args.log_dir)
        if args.log_dir
        else Path(tempfile.mkdtemp(prefix="bench-eviction-logs-"))
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    log(f"model {model}; server logs in {log_dir}")
    meta = machine.provenance(REPO)
    emit({**meta, "loadavg_1m": loadavg(), "args": {k: v for k, v in vars(args).items()}})
    log(f"plugin code: {meta['sgl_vtoken_source']} ({meta['plugin_code']})")
    if args.part in ("capacity", "all"):
        capacity(args, model, log_dir)
    if args.part in ("overhead", "all"):
        plugin_overhead.overhead(args, model, log_dir, say=log, emit=emit)
    return 0
