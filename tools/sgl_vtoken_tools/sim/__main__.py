"""``python -m sgl_vtoken_tools.sim``: replay seeded traces under every policy, ratio, page size, mode.

Writes ``summary.jsonl`` (one line per workload, policy, ratio, page size, mode), optionally
``requests.jsonl`` (one line per request and mode), ``table.md``, PNG plots, and can refresh the
simulator section of a results file between its ``<!-- sim:begin -->`` / ``<!-- sim:end -->``
markers. Defaults finish in about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from sgl_vtoken.policies import POLICIES
from sgl_vtoken_tools.cli.common import numbers
from sgl_vtoken_tools.sim.replay import SimSettings, replay_request
from sgl_vtoken_tools.sim.report import markdown_tables, plot, summarize
from sgl_vtoken_tools.sim.workload import WORKLOADS

SIM_POLICIES = sorted(POLICIES)
BEGIN, END = "<!-- sim:begin -->", "<!-- sim:end -->"
COMMAND = (
    "python -m sgl_vtoken_tools.sim --out docs/sim --img-dir docs/img"
    " --results-md docs/results/simulator.md"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m sgl_vtoken_tools.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workloads", nargs="+", default=sorted(WORKLOADS), choices=sorted(WORKLOADS))
    p.add_argument("--policies", nargs="+", default=SIM_POLICIES, choices=SIM_POLICIES)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    p.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--table-page-size", type=int, default=16)
    p.add_argument("--sessions", type=int, default=8, help="agent sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per agent session")
    p.add_argument("--requests", type=int, default=48, help="sharegpt-like requests")
    numbers(p, seed=0, sink=4, window_frac=0.5)
    p.add_argument("--interval", type=int, default=0, help="0 = max(page_size, 32)")
    numbers(p, prefill_chunk=256, pool_tokens=6144)
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes of one token (default: Llama-3.1-8B, bf16: 32 x 8 x 128 x 2 x 2)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", default="sim_out")
    p.add_argument("--img-dir", default=None, help="PNG plots here (default: OUT)")
    p.add_argument("--per-request", action="store_true", help="also write requests.jsonl")
    p.add_argument("--results-md", default=None, help="refresh the section between sim markers")
    return p.parse_args(argv)


def _trace(args, workload):
    if workload == "agent":
        return WORKLOADS[workload](num_sessions=args.sessions, turns=args.turns, seed=args.seed)
    return WORKLOADS[workload](num_requests=args.requests, seed=args.seed)


def _job(job):
    workload, requests, policy, settings = job
    torch.set_num_threads(1)
    rows = []
    for req in requests:
        rows += [{"workload": workload, **r} for r in replay_request(req, policy, settings)]
    return rows


def run(args) -> list[dict]:
    jobs = []
    for wl in args.workloads:
        reqs = _trace(args, wl)
        for ps in args.page_sizes:
            for ratio in args.ratios:
                s = SimSettings(
                    ratio=ratio,
                    page_size=ps,
                    sink=args.sink,
                    window_frac=args.window_frac,
                    interval=args.interval,
                    prefill_chunk=args.prefill_chunk,
                    seed=args.seed,
                )
                jobs += [(wl, reqs, pol, s) for pol in args.policies]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            results = list(ex.map(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    return [r for rows in results for r in rows]


def update_results(path: str, section: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Results\n"
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    rows = run(args)
    summary = summarize(rows, args.pool_tokens, args.kv_bytes_per_token)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.jsonl"), "w") as f:
        f.writelines(json.dumps(s, sort_keys=True) + "\n" for s in summary)
    if args.per_request:
        with open(os.path.join(args.out, "requests.jsonl"), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    table = markdown_tables(summary, args.table_page_size)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    paths = plot(summary, args.img_dir or args.out, args.table_page_size)
    if args.results_md:
        rel = os.path.relpath(args.img_dir or args.out, os.path.dirname(args.results_md) or ".")
        imgs = "".join(f"![{os.path.basename(p)}]({rel}/{os.path.basename(p)})\n" for p in paths)
        update_results(args.results_md, f"{table}\n{imgs}")
    print(table)
    print(
        f"{len(rows)} request-mode rows, {len(summary)} summaries in {time.time() - t0:.1f}s "
        f"-> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
