#!/usr/bin/env python
"""Multi-turn agent benchmark against a running OpenAI-compatible server, as JSON lines.

    python scripts/bench_agent.py --base-url http://127.0.0.1:30000 --sessions 8 --turns 4 \\
        --rate 2 --seed 0 --out agent.jsonl

Workload (seeded, the same for every server that shares a tokenizer). `--sessions` agent
sessions start at Poisson arrival times (`--rate` sessions per second; `inf`: all at once). A
session is one conversation of `--turns` streaming chat completions:

    system     shared by every session: instructions plus a JSON tool schema (`--system-tokens`)
    turn 1     user task (lognormal, median `--user-tokens`)            -> assistant reply
    turn k>1   tool output of varied length (lognormal, median `--tool-tokens`, clipped to
               [`--tool-min`, `--tool-max`]) as a `--tool-role` message  -> assistant reply

Every request re-sends the whole history; each assistant reply is exactly `--reply-tokens` tokens
(`max_tokens` + `ignore_eos`, an SGLang extension; `--no-ignore-eos` for other servers) and goes
back into the history. Lengths are in tokens of the server's tokenizer when the server answers
`/v1/tokenize` and `/v1/detokenize` (SGLang does), else approximate (one word ~ 1.3 tokens); the
report has the real counts from `usage`. The next turn starts `--think-time` seconds after the
reply (tool execution time).

Measured per request (streaming, `stream_options.include_usage`): TTFT = time to the first chunk
that carries a choice (SGLang and vLLM send the role chunk with the first token), TPOT = (E2E -
TTFT) / (completion tokens - 1), E2E latency, prompt/completion/cached tokens (cached needs
SGLang's `--enable-cache-report`). Reported per turn and overall: p50/p95/p99 of each, output
tokens/s over the run's wall time, requests completed and failed.

Server side, read before and after the run (deltas) and sampled every `--sample-interval` s by a
background thread:
- `/v1/loads`: running and waiting requests, KV tokens in use (total - available -
  radix-evictable) -> `peak_running_sampled`, `mean_running_sampled` (samples with requests
  running), `kv_pages_per_running_req` = mean of tokens in use / page size / running requests;
- `/server_info` (`/get_server_info` on older servers) -> `internal_states[0]["vtoken"]`
  (sgl-vtoken servers): deltas of the counters evictions, evicted_tokens, pages_freed,
  tokens_moved, bytes_moved; peak_running_requests and peak_retained_pages as the server reports
  them (since its start); the gauges retained_pages and live_tokens (the last decode step's
  running evicting requests) sampled -> `retained_pages_per_req` = mean over the samples of
  retained_pages / (live_tokens // budget): a request past its first eviction keeps between
  budget and budget + interval live tokens, so live_tokens // budget counts the requests of the
  same step (exact when prompts exceed budget + interval and interval < budget; the running count
  of /v1/loads is a separate snapshot and can be a step off). Reported only when the run evicts
  (server policy or `--kv-evict-json` other than none), else `vtoken` is null;
- `/metrics` (with `--enable-metrics`): deltas of `sglang:num_requests_total`,
  `prompt_tokens_total`, `generation_tokens_total`, `cached_tokens_total`,
  `num_retracted_requests_total` (retractions; SGLang creates that counter at the first
  retraction, so it counts 0 while its gauge `num_retracted_reqs` is exported),
  `scheduler_process_cpu_seconds_total` -> `scheduler_cpu_s` and `output_tokens_per_cpu_s`
  (CPU time of the scheduler process, recorded about once a second: a throughput figure that
  other jobs on a shared machine disturb much less than wall time);
- `--server-log PATH` (the server's log file, e.g. the one `ServerProcess` writes): the part
  written during the run gives `peak_running_log`, the largest `Decode batch, #running-req: N`
  (every decode step with `--decode-log-interval 1`), and the retraction lines; retractions come
  from the log when /metrics is off, else they are "unknown" (null).
`peak_running` is the larger of the log's and the samples' peaks.

`--kv-evict-json '{"policy": "random", "budget": 128}'` sends the object as
`extra_body={"custom_params": {"kv_evict": ...}}` with every request (sgl-vtoken's per-request
override); without it the server's own flags apply.

Output: JSON lines to `--out` (default stdout): one `config` line, one `request` line per request,
one `sample` line per background sample (`--no-samples` to omit), one `turn` line per turn and a
final `summary` line. The turn and summary lines also go to stderr as a short table. Progress bar
(tqdm) on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VTOKEN_CUMULATIVE = ("evictions", "evicted_tokens", "pages_freed", "tokens_moved", "bytes_moved")

from agent_workload import TokenFitter, build_workload, run_session  # noqa: E402
from server_probe import (METRIC_COUNTERS, Sampler, get_json, parse_log, scrape_metrics,  # noqa: E402
                          server_info, vtoken_state)


# ----------------------------------------------------------------------------- the run


def percentiles(values: list[float], scale: float = 1.0, digits: int = 1) -> dict:
    """p50/p95/p99 (linear interpolation) and mean, times `scale`; None entries when empty."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p95": None, "p99": None, "mean": None}

    def q(p):
        k = (len(vals) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

    return {**{f"p{int(p * 100)}": round(q(p) * scale, digits) for p in (0.5, 0.95, 0.99)},
            "mean": round(sum(vals) / len(vals) * scale, digits)}


def summarize(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["error"] is None]
    cached = [r["cached_tokens"] for r in ok]
    return {
        "requests": len(recs), "completed": len(ok), "failed": len(recs) - len(ok),
        "ttft_ms": percentiles([r["ttft"] for r in ok], 1000),
        "tpot_ms": percentiles([r["tpot"] for r in ok], 1000, 2),
        "e2e_ms": percentiles([r["e2e"] for r in ok], 1000),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "completion_tokens": sum(r["completion_tokens"] for r in ok),
        "cached_tokens": None if any(c is None for c in cached) else sum(cached),
    }


def delta(after: dict | None, before: dict | None, keys) -> dict | None:
    if after is None or before is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def run_benchmark(args, out=None, progress: bool = True) -> dict:
    """Run the whole benchmark; write JSON lines to `out` (a file object) and return the summary."""
    args.base_url = args.base_url.rstrip("/")
    if args.model is None:
        models = get_json(args.base_url, "/v1/models") or {}
        args.model = (models.get("data") or [{}])[0].get("id", "default")
    emit = (lambda rec: out.write(json.dumps(rec) + "\n")) if out is not None else (lambda rec: None)

    fitter = TokenFitter(args.base_url, args.model)
    system, sessions = build_workload(args, fitter)
    info0 = server_info(args.base_url) or {}
    st0 = vtoken_state(args.base_url, info0)
    server_policy = ((st0 or {}).get("config") or {}).get("policy", "none")
    policy = (args.kv_evict_json or {}).get("policy", server_policy)
    evicting = policy not in (None, "none")
    emit({"kind": "config", "base_url": args.base_url, "model": args.model, "sessions": args.sessions,
          "turns": args.turns, "rate": None if math.isinf(args.rate) else args.rate,
          "max_concurrency": args.max_concurrency, "seed": args.seed,
          "system_tokens": args.system_tokens, "system_tokens_actual": args.system_tokens_actual,
          "user_tokens": args.user_tokens,
          "tool_tokens": args.tool_tokens, "tool_min": args.tool_min, "tool_max": args.tool_max,
          "reply_tokens": args.reply_tokens, "think_time": args.think_time, "tool_role": args.tool_role,
          "kv_evict": args.kv_evict_json, "exact_token_lengths": fitter.exact,
          "server_vtoken_config": (st0 or {}).get("config"), "label": args.label,
          "session_starts": [round(s.start, 3) for s in sessions]})

    log_path = Path(args.server_log) if args.server_log else None
    log_offset = log_path.stat().st_size if log_path and log_path.exists() else 0
    m0 = scrape_metrics(args.base_url)
    t0 = time.monotonic()
    sampler = Sampler(args.base_url, args.sample_interval, t0, evicting) if args.sample_interval > 0 else None
    if sampler:
        sampler.start()

    total = args.sessions * args.turns
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=args.label or "agent", unit="req", file=sys.stderr, leave=False)
    lock = threading.Lock()

    def on_done(rec):
        with lock:
            if bar is not None:
                bar.update(1)

    recs: list[dict] = []
    slots = threading.Semaphore(args.max_concurrency) if args.max_concurrency else None
    with ThreadPoolExecutor(max_workers=max(1, args.sessions)) as pool:
        futures = [pool.submit(run_session, s, system, args, t0, on_done, slots) for s in sessions]
        for f in futures:
            recs.extend(f.result())
    duration = time.monotonic() - t0
    if sampler:
        sampler.stop()
    if bar is not None:
        bar.close()
    m1 = scrape_metrics(args.base_url)
    st1 = vtoken_state(args.base_url)

    recs.sort(key=lambda r: (r["t_start"], r["session"], r["turn"]))
    for r in recs:
        emit({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
    samples = sampler.samples if sampler else []
    if args.samples:
        for s in samples:
            emit({"kind": "sample", **s})

    turns = []
    for turn in range(1, args.turns + 1):
        t = {"kind": "turn", "label": args.label, "turn": turn, **summarize([r for r in recs if r["turn"] == turn])}
        turns.append(t)
        emit(t)

    overall = summarize(recs)
    ok_end = max((r["t_end"] for r in recs if r["error"] is None), default=duration)
    summary = {"kind": "summary", "label": args.label, **overall, "duration_s": round(duration, 3),
               "system_prompt_tokens": args.system_tokens_actual,
               "output_tokens_per_s": round(overall["completion_tokens"] / ok_end, 2) if ok_end > 0 else None,
               "requests_per_s": round(overall["completed"] / ok_end, 3) if ok_end > 0 else None}

    # Concurrency and memory from the background samples.
    running = [s["running"] for s in samples if s.get("running") is not None]
    busy = [s for s in samples if s.get("running")]
    page = args.page_size or info0.get("page_size")
    summary["samples"] = len(samples)
    summary["peak_running_sampled"] = max(running, default=None)
    summary["mean_running_sampled"] = round(sum(s["running"] for s in busy) / len(busy), 2) if busy else None
    if busy and page and all(s.get("kv_used_tokens") is not None for s in busy):
        summary["kv_pages_per_running_req"] = round(
            sum(s["kv_used_tokens"] / page / s["running"] for s in busy) / len(busy), 2)
    else:
        summary["kv_pages_per_running_req"] = None
    summary["peak_kv_used_tokens"] = max((s.get("kv_used_tokens") or 0 for s in busy), default=None)

    # Server log written during the run.
    if log_path and log_path.exists():
        with open(log_path, "rb") as f:
            f.seek(log_offset)
            summary["log"] = parse_log(f.read().decode(errors="replace"))
        summary["peak_running_log"] = summary["log"]["peak_running_requests"]
    else:
        summary["log"] = None
        summary["peak_running_log"] = None

    # Prometheus counters.
    summary["metrics_delta"] = delta(m1, m0, METRIC_COUNTERS)
    cpu = (summary["metrics_delta"] or {}).get("scheduler_process_cpu_seconds_total")
    summary["scheduler_cpu_s"] = round(cpu, 2) if cpu else None
    summary["output_tokens_per_cpu_s"] = round(overall["completion_tokens"] / cpu, 1) if cpu else None
    if m1 is not None and m1.get("retractions_exported"):
        summary["retractions"] = int(summary["metrics_delta"]["num_retracted_requests_total"])
        summary["retractions_source"] = "metrics"
    elif summary["log"] is not None:
        summary["retractions"] = summary["log"]["retracted_requests"]
        summary["retractions_source"] = "log"
    else:
        summary["retractions"] = None
        summary["retractions_source"] = "unknown"

    # vToken counters (sgl-vtoken servers with eviction on).
    if evicting and st1 is not None:
        # The gauges describe the last decode step's evicting requests; /v1/loads is a separate
        # (and possibly older) snapshot, so the request count comes from the gauges themselves:
        # a request past its first eviction holds budget <= live < budget + interval <= 2 * budget
        # tokens, so live_tokens // budget counts them.
        budget = (args.kv_evict_json or {}).get("budget") or ((st0 or {}).get("config") or {}).get("budget")
        retained = [s["retained_pages"] / (s["live_tokens"] // budget) for s in busy
                    if budget and s.get("retained_pages") and (s.get("live_tokens") or 0) >= budget]
        summary["vtoken"] = {
            "delta": delta(st1, st0, VTOKEN_CUMULATIVE),
            "peak_running_requests": st1.get("peak_running_requests"),
            "peak_retained_pages": st1.get("peak_retained_pages"),
            "after": {k: v for k, v in st1.items() if k != "config"},
            "retained_pages_per_req": round(sum(retained) / len(retained), 2) if retained else None,
            "peak_retained_pages_sampled": max((s.get("retained_pages") or 0 for s in samples), default=None),
        }
    else:
        summary["vtoken"] = None
    peaks = [p for p in (summary["peak_running_log"], summary["peak_running_sampled"]) if p is not None]
    summary["peak_running"] = max(peaks) if peaks else None
    emit(summary)
    if out is not None:
        out.flush()
    return {"summary": summary, "turns": turns, "requests": recs, "samples": samples}


def print_table(result: dict, stream=sys.stderr) -> None:
    s = result["summary"]
    print(f"{'turn':>5} {'n':>4} {'ttft p50/p95 ms':>18} {'tpot p50 ms':>12} {'e2e p95 ms':>11} {'prompt':>8} {'cached':>7}",
          file=stream)
    for t in result["turns"] + [dict(s, turn="all")]:
        n = max(1, t["completed"])
        cached = "-" if t["cached_tokens"] is None else t["cached_tokens"] // n
        print(f"{t['turn']:>5} {t['completed']:>4} {str(t['ttft_ms']['p50']) + ' / ' + str(t['ttft_ms']['p95']):>18} "
              f"{str(t['tpot_ms']['p50']):>12} {str(t['e2e_ms']['p95']):>11} {t['prompt_tokens'] // n:>8} {cached:>7}",
              file=stream)
    vt = s["vtoken"] or {}
    print(f"output tok/s {s['output_tokens_per_s']}, peak running {s['peak_running']} "
          f"(log {s['peak_running_log']}, sampled {s['peak_running_sampled']}), retractions {s['retractions']} "
          f"({s['retractions_source']}), failed {s['failed']}, KV pages/running req {s['kv_pages_per_running_req']}"
          + (f", vToken evicted {vt['delta']['evicted_tokens']}, retained pages/req {vt['retained_pages_per_req']}"
             if vt else ""), file=stream)


def parse_rate(value: str) -> float:
    rate = math.inf if value.lower() in ("inf", "infinity") else float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf (got {value})")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name for the API (default: the first of /v1/models)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=parse_rate, default=math.inf, help="session arrivals per second (Poisson); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=0,
                   help="sessions in flight at once (0: no limit; 1 with --rate inf: the unloaded baseline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-tokens", type=int, default=256, help="shared system prompt incl. the tool schema")
    p.add_argument("--user-tokens", type=int, default=40, help="median length of the user task")
    p.add_argument("--tool-tokens", type=int, default=300, help="median length of a tool output")
    p.add_argument("--tool-min", type=int, default=32)
    p.add_argument("--tool-max", type=int, default=1024)
    p.add_argument("--reply-tokens", type=int, default=64, help="assistant reply length (every turn)")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between a reply and the next turn")
    p.add_argument("--tool-role", choices=("tool", "user"), default="tool")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (servers without that extension; replies may be shorter)")
    p.add_argument("--kv-evict-json", type=json.loads, default=None,
                   help="per-request kv_evict object sent in custom_params, e.g. '{\"policy\": \"random\", \"budget\": 128}'")
    p.add_argument("--server-log", default=None, help="the server's log file, read for running requests and retractions")
    p.add_argument("--page-size", type=int, default=None, help="page size for pages-in-use figures (default: from the server)")
    p.add_argument("--sample-interval", type=float, default=0.5, help="seconds between server samples (0: none)")
    p.add_argument("--no-samples", dest="samples", action="store_false", help="do not write sample lines")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--label", default=None, help="a name carried into every summary line")
    p.add_argument("--out", default=None, help="JSON lines file (default: stdout)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out:
        with open(args.out, "w") as f:
            result = run_benchmark(args, f, progress=args.progress)
    else:
        result = run_benchmark(args, sys.stdout, progress=args.progress)
    print_table(result)
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
