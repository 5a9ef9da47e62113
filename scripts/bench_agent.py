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

Request ids are fixed: turn t of session i is `{--rid-prefix}-s{i}-t{t}` (SGLang's `rid`
field of the chat request), so two servers that play the same workload see the same ids, and a
seeded per-request choice such as the `random` policy's victims (seeded from the request id) is
the same on both. Ids must be unique among the requests in flight on a server, and SGLang aborts
a streamed request's id 2 s after its stream ended if a request with that id is in flight then
(its clean-up for clients that disconnect): give runs on one server that overlap or follow each
other within seconds different prefixes (`--rid-prefix ''`: the server assigns ids). A reply
the server aborted counts as a failed request.

The run itself is `sgl_vtoken_tools.bench.agent.run_benchmark`; figure definitions are in
`sgl_vtoken_tools/bench/agent_summary.py`.

Output: JSON lines to `--out` (default stdout): one `config` line, one `request` line per request
(with its `rid` and `output_hash`, a digest of the reply),
one `sample` line per background sample (`--no-samples` to omit), one `turn` line per turn and a
final `summary` line. The turn and summary lines also go to stderr as a short table. Progress bar
(tqdm) on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from sgl_vtoken_tools.bench.agent import AgentConfig, print_table, run_benchmark
from sgl_vtoken_tools.bench.workload import WorkloadSpec


def parse_rate(value: str) -> float:
    rate = math.inf if value.lower() in ("inf", "infinity") else float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"rate must be > 0 or inf (got {value})")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument(
        "--model", default=None, help="model name for the API (default: the first of /v1/models)"
    )
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument(
        "--rate",
        type=parse_rate,
        default=math.inf,
        help="session arrivals per second (Poisson); inf = all at once",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="sessions in flight at once (0: no limit; 1 with --rate inf: the unloaded baseline)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--system-tokens", type=int, default=256, help="shared system prompt incl. the tool schema"
    )
    p.add_argument("--user-tokens", type=int, default=40, help="median length of the user task")
    p.add_argument("--tool-tokens", type=int, default=300, help="median length of a tool output")
    p.add_argument("--tool-min", type=int, default=32)
    p.add_argument("--tool-max", type=int, default=1024)
    p.add_argument(
        "--reply-tokens", type=int, default=64, help="assistant reply length (every turn)"
    )
    p.add_argument(
        "--think-time", type=float, default=0.0, help="seconds between a reply and the next turn"
    )
    p.add_argument("--tool-role", choices=("tool", "user"), default="tool")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (servers without that extension; replies may be shorter)",
    )
    p.add_argument(
        "--kv-evict-json",
        type=json.loads,
        default=None,
        help='per-request kv_evict object sent in custom_params, e.g. \'{"policy": "random", "budget": 128}\'',
    )
    p.add_argument(
        "--rid-prefix",
        default="agent",
        help="request ids are PREFIX-s{session}-t{turn} ('': the server assigns them)",
    )
    p.add_argument(
        "--server-log",
        default=None,
        help="the server's log file, read for running requests and retractions",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="page size for pages-in-use figures (default: from the server)",
    )
    p.add_argument(
        "--sample-interval",
        type=float,
        default=0.5,
        help="seconds between server samples (0: none)",
    )
    p.add_argument(
        "--no-samples", dest="samples", action="store_false", help="do not write sample lines"
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--label", default=None, help="a name carried into every summary line")
    p.add_argument("--out", default=None, help="JSON lines file (default: stdout)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The parsed command line as an AgentConfig (ValueError naming the field when out of range)."""
    workload = WorkloadSpec(
        sessions=args.sessions,
        turns=args.turns,
        rate=args.rate,
        seed=args.seed,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        tool_tokens=args.tool_tokens,
        tool_min=args.tool_min,
        tool_max=args.tool_max,
    )
    return AgentConfig(
        base_url=args.base_url,
        workload=workload,
        model=args.model,
        max_concurrency=args.max_concurrency,
        reply_tokens=args.reply_tokens,
        think_time=args.think_time,
        tool_role=args.tool_role,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        kv_evict=args.kv_evict_json,
        rid_prefix=args.rid_prefix or None,
        server_log=args.server_log,
        page_size=args.page_size,
        sample_interval=args.sample_interval,
        write_samples=args.samples,
        request_timeout=args.request_timeout,
        label=args.label,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(f"--{str(e).split(' ', 1)[0].replace('_', '-')}: {e}")
    if args.out:
        with open(args.out, "w") as f:
            result = run_benchmark(cfg, f, progress=args.progress)
    else:
        result = run_benchmark(cfg, sys.stdout, progress=args.progress)
    print_table(result)
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
