"""The plugin's cost when off: single-stream decode tokens/s and server CPU per token of
`--kv-evict none` against SGLang without the plugin (tools/sgl_vtoken_tools/cli/eviction.py --part overhead,
whose docstring describes the baseline and its shim)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from sgl_vtoken_tools.bench import machine
from sgl_vtoken_tools.bench.baseline import (
    baseline_env,
    group_cpu_seconds,
    plugin_in_server,
    shim_applications,
    thread_env,
)
from sgl_vtoken_tools.bench.http_client import generate
from sgl_vtoken_tools.bench.load import random_ids
from sgl_vtoken_tools.bench.machine import loadavg
from sgl_vtoken_tools.bench.server_log import error_lines


def single_stream(server, args) -> tuple[list[float], int, float]:
    """Tokens/s of each timed request, total timed tokens, server CPU seconds over them."""
    prompt = random_ids(args.prompt_len, seed=20_000)
    speeds, tokens, cpu = [], 0, 0.0
    for run in range(args.runs + 1):  # the first request warms up and is not counted
        c0, t0 = group_cpu_seconds(server.proc.pid), time.perf_counter()
        out = generate(server.base_url, prompt, args.overhead_tokens, args.request_timeout)
        dt, dc = time.perf_counter() - t0, group_cpu_seconds(server.proc.pid) - c0
        if run:
            n = out["meta_info"]["completion_tokens"]
            speeds.append(n / dt)
            tokens += n
            cpu += dc
    return speeds, tokens, cpu


def overhead(args, model: Path, log_dir: Path, *, say, emit) -> None:
    """Rounds of ABBA-ordered servers, baseline and plugin; one `emit`ted record per server and
    round, then the summary (`say`: progress lines)."""
    from sgl_vtoken_tools.launcher import ServerProcess, cpu_server_args

    base = cpu_server_args(model, args.max_total_tokens, args.page_size) + ["--dtype", "float32"]
    with baseline_env(args.baseline_plugins) as stock:
        baseline_name = (
            f"sglang without sgl-vtoken (SGLANG_PLUGINS={stock['SGLANG_PLUGINS']}) "
            "+ sitecustomize shim setting rotary_embedding.base._is_cpu"
        )
        servers = {
            "baseline": (base, {**thread_env(args), **stock}),
            "plugin": (base + ["--kv-evict", "none"], thread_env(args)),
        }
        speeds: dict[str, list[float]] = {"baseline": [], "plugin": []}
        cpu_per_tok: dict[str, list[float]] = {"baseline": [0.0, 0], "plugin": [0.0, 0]}
        for rnd in range(args.rounds):
            order = (
                ("baseline", "plugin") if rnd % 2 == 0 else ("plugin", "baseline")
            )  # ABBA over rounds
            for which in order:
                flags, env = servers[which]
                log_path = log_dir / f"overhead-{which}-r{rnd}.log"
                machine.wait_for_quiet(args.wait_load, args.wait_load_timeout, say=say)
                say(
                    f"overhead {which} (round {rnd + 1}/{args.rounds}): starting server (log {log_path})"
                )
                with ServerProcess(
                    flags, env=env, log_path=log_path, startup_timeout=args.startup_timeout
                ) as server:
                    la = loadavg()
                    runs, tokens, cpu = single_stream(server, args)
                    plugin_loaded = plugin_in_server(server)
                    time.sleep(0.5)
                    text = server.log_text()
                speeds[which] += runs
                cpu_per_tok[which][0] += cpu
                cpu_per_tok[which][1] += tokens
                record = {
                    "part": "overhead",
                    "server": which,
                    "round": rnd,
                    "what": baseline_name
                    if which == "baseline"
                    else "sgl-vtoken plugin installed, --kv-evict none",
                    "median_tokens_per_s": round(statistics.median(runs), 1),
                    "best_tokens_per_s": round(max(runs), 1),
                    "runs": [round(s, 1) for s in runs],
                    "new_tokens": args.overhead_tokens,
                    "server_cpu_ms_per_token": round(1000 * cpu / tokens, 3) if tokens else None,
                    "prompt_tokens": args.prompt_len,
                    "page_size": args.page_size,
                    "loadavg_1m_before": la,
                    "log": str(log_path),
                    "log_errors": error_lines(text),
                    "plugin_loaded": plugin_loaded,
                }
                if which == "baseline":
                    record["shim_applied_in_processes"] = shim_applications(text)
                    if record["plugin_loaded"]:
                        say("WARNING: the baseline server runs the plugin")
                    if record["shim_applied_in_processes"] == 0:
                        say("WARNING: the baseline shim left no trace in the server log")
                emit(record)
                say(
                    f"overhead {which}: median {record['median_tokens_per_s']} tok/s {record['runs']}"
                )

    b, p = statistics.median(speeds["baseline"]), statistics.median(speeds["plugin"])
    rel = (p - b) / b
    spread = {k: round((max(v) - min(v)) / statistics.median(v), 3) for k, v in speeds.items()}
    cpu_b, cpu_p = (
        1000 * c / n if n else float("nan")
        for c, n in (cpu_per_tok["baseline"], cpu_per_tok["plugin"])
    )
    emit(
        {
            "part": "overhead",
            "summary": True,
            "baseline": baseline_name,
            "baseline_median_tokens_per_s": round(b, 1),
            "plugin_median_tokens_per_s": round(p, 1),
            "relative_diff": round(rel, 4),
            "plugin_slower_pct": round(-100 * rel, 2),
            "within_1pct": abs(rel) <= 0.01,
            "baseline_best_tokens_per_s": round(max(speeds["baseline"]), 1),
            "plugin_best_tokens_per_s": round(max(speeds["plugin"]), 1),
            "baseline_cpu_ms_per_token": round(cpu_b, 3),
            "plugin_cpu_ms_per_token": round(cpu_p, 3),
            "cpu_per_token_relative_diff": round((cpu_p - cpu_b) / cpu_b, 4),
            "runs_per_server": args.runs * args.rounds,
            "rounds": args.rounds,
            "relative_spread": spread,
            "new_tokens": args.overhead_tokens,
        }
    )
