"""Stress one sgl-vtoken server with mixed traffic, then check it for crashes and leaks.

    python -m sgl_vtoken_tools stress                          # 5 minutes, tiny model, CPU, page 16
    python -m sgl_vtoken_tools stress --page-size 1 --duration 120
    python -m sgl_vtoken_tools stress --kv-evict-config '{"prefill_chunk": 64}' --disable-overlap-schedule
    python -m sgl_vtoken_tools stress --kv-evict-config '{"host_tokens": 65536, "offload": true, "recall": 32}' \
        --budgets 128,256
    python -m sgl_vtoken_tools stress --retract                # SGLang's forced retractions (SGLANG_TEST_RETRACT)
    python -m sgl_vtoken_tools stress --base-url http://127.0.0.1:30000 --server-log server.log

Starts the tiny model on CPU (`--kv-evict P --kv-budget B --kv-evict-interval I --kv-evict-trigger T`, pool
`--max-total-tokens POOL`) with SGLang's memory checkers on (SGLANG_ENABLE_STRICT_MEM_CHECK_
DURING_BUSY, SGLANG_DEBUG_MEMORY_POOL, SGLANG_CHECK_KV_PAGE_INVARIANTS), or uses `--base-url`.
`--workers` request loops then send, for `--duration` seconds, a seeded mix of /generate (plain
and streamed) and chat completions (plain and streamed), multi-turn chat sessions, requests
aborted through /abort_request or by the client disconnecting, invalid `kv_evict` objects
(expected HTTP 400) and, with `--over-pool`, prompts longer than the pool (answered with
`prefill_chunk`, else HTTP 400); each with a random eviction setting (the server's, `{"policy": "none"}`, or
a random policy, budget and window in `custom_params.kv_evict`), short or long prompts (some
sharing a prefix) and short or long replies. After the load drains: no unexpected outcome, the
server healthy, no traceback in its log, `pool_available + pool_evictable == pool_total`, and
the whole pool free after /flush_cache (`sgl_vtoken_tools.bench.stress`).

JSON lines to stdout and `--out`: `config`, `progress` every `--progress-every` s, `unexpected`
(each request with an unexpected outcome), `summary` (requests by kind and outcome, evictions,
aborts, retractions, peak running, final pool state, the checks). `--requests-out` gets one line
per request. Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from sgl_vtoken.patches.core.shortage import KINDS as SHORTAGE_KINDS
from sgl_vtoken_tools import forced_shortage
from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.bench.stress import MEMORY_CHECKS, StressConfig, run_stress
from sgl_vtoken_tools.bench.stress_spec import FORCED, TrafficSpec
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args, evict_args


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, __name__)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    p.add_argument("--workers", type=int, default=8, help="concurrent request loops")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--base-url", default=None, help="stress this running server instead of starting one"
    )
    p.add_argument(
        "--server-log", default=None, help="with --base-url: its log file, checked for tracebacks"
    )
    p.add_argument(
        "--model-path", default=None, help="default: the tiny model in .cache/tiny-llama"
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool", type=int, default=4096, help="--max-total-tokens")
    p.add_argument("--policy", default="streamingllm", help="the server's --kv-evict")
    p.add_argument("--budget", type=int, default=128, help="the server's --kv-budget")
    p.add_argument("--interval", type=int, default=16, help="the server's --kv-evict-interval")
    p.add_argument(
        "--trigger",
        default="budget",
        choices=("budget", "pressure"),
        help="the server's --kv-evict-trigger",
    )
    p.add_argument("--kv-evict-config", default=None, help="the server's --kv-evict-config (JSON)")
    p.add_argument(
        "--disable-overlap-schedule", action="store_true", help="(prefill_chunk needs it)"
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated budgets a request may ask for (default 48,64,128,256); with a server "
        "recall, each must hold sink + window + recall + 1",
    )
    p.add_argument(
        "--retract",
        action="store_true",
        help="SGLang retracts running requests on purpose (SGLANG_TEST_RETRACT, every 25 steps)",
    )
    p.add_argument(
        "--forced-shortages",
        default=None,
        help="comma-separated page kinds (copies, tail, resume, recall) a few requests are refused on "
        "purpose (sgl_vtoken_tools/forced_shortage.py), so every shortage path is met next to those real pressure "
        "reaches; the summary's shortages count those apart (forced:...)",
    )
    p.add_argument(
        "--over-pool",
        action="store_true",
        help="also send prompts of 1.2-3x the pool (kind over_pool): answered where the server's "
        "--kv-evict-config has prefill_chunk, HTTP 400 naming it otherwise",
    )
    p.add_argument("--progress-every", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=None, help="JSON lines file (besides stdout)")
    p.add_argument("--requests-out", type=Path, default=None, help="one JSON line per request")
    p.add_argument(
        "--table",
        type=Path,
        nargs="+",
        metavar="JSONL",
        help="only print the markdown table of these runs' JSON lines (--out files), and exit",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.table:
        from sgl_vtoken_tools.bench.stress_table import HEADER, row

        print("\n".join([HEADER] + [row(p) for p in args.table]))
        return 0
    if args.server_log and not args.base_url:
        parser.error(
            "--server-log goes with --base-url (a server this script starts logs to its own file)"
        )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the server is stopped
    log, per_request = RunLog(args.out, echo=True), RunLog(args.requests_out)
    emit = log.emit

    server = None
    try:
        if args.base_url is None:
            from sgl_vtoken_tools.bench.cell_server import resolve_model

            model = args.model_path or resolve_model("tiny")
            flags = ["--dtype", "float32", "--enable-metrics"]
            flags += evict_args(args.policy, args.budget, args.interval)
            flags += ["--kv-evict-trigger", args.trigger]
            flags += ["--kv-evict-config", args.kv_evict_config] if args.kv_evict_config else []
            flags += ["--disable-overlap-schedule"] if args.disable_overlap_schedule else []
            env = {
                **MEMORY_CHECKS,
                **(
                    {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "25"}
                    if args.retract
                    else {}
                ),
                **(forced_shortage.server_env(FORCED) if args.forced_shortages else {}),
            }
            server = ServerProcess(
                cpu_server_args(model, args.pool, args.page_size) + flags, env=env
            ).start()
            emit(
                {
                    "kind": "server",
                    "flags": flags,
                    "page_size": args.page_size,
                    "pool": args.pool,
                    "env": env,
                    "startup_s": round(server.startup_seconds, 1),
                }
            )
        try:
            budgets = (
                {"budgets": tuple(int(b) for b in args.budgets.split(","))} if args.budgets else {}
            )
        except ValueError:
            parser.error(f"--budgets: comma-separated integers, got {args.budgets!r}")
        server_cfg = json.loads(args.kv_evict_config or "{}")
        # On a server with a host store requests vary offload and recall too.
        host = {"recalls": (0, 16, 32)} if server_cfg.get("host_tokens") else {}
        forced = tuple(k for k in (args.forced_shortages or "").split(",") if k)
        unknown = sorted(set(forced) - set(SHORTAGE_KINDS))
        if unknown:
            parser.error(
                f"--forced-shortages: unknown page kind {unknown[0]!r}; choose from {list(SHORTAGE_KINDS)}"
            )
        over = (
            {
                "over_pool": (int(1.2 * args.pool), 3 * args.pool),
                "over_pool_served": bool(server_cfg.get("prefill_chunk")),
            }
            if args.over_pool
            else {}
        )
        traffic = TrafficSpec(**budgets, **host, **over, shortages=forced)
        try:
            cfg = StressConfig(
                base_url=args.base_url or server.base_url,
                duration_s=args.duration,
                workers=args.workers,
                seed=args.seed,
                progress_every_s=args.progress_every,
                server_log=args.server_log or (str(server.log_path) if server else None),
                traffic=traffic,
            )
        except ValueError as e:
            parser.error(f"--duration/--workers: {e}")
        summary = run_stress(cfg, emit, per_request.emit)
    finally:
        if server is not None:
            server.stop()
        log.close()
        per_request.close()
    failed = [k for k, v in summary["checks"].items() if v is False]
    print(
        ("stress: every check passed" if summary["ok"] else f"stress: FAILED {', '.join(failed)}")
        + (f" (server log {server.log_path})" if server else ""),
        file=sys.stderr,
    )
    return 0 if summary["ok"] else 1
