"""No-Evict vs Naive-Evict vs vToken on the multi-turn agent benchmark, same KV pool, repeated.

    make bench                                       # = python -m sgl_vtoken_tools matrix: the CPU page
    python -m sgl_vtoken_tools matrix --quick           # smoke: 2 sessions x 2 turns, burst runs only
    python -m sgl_vtoken_tools matrix --policies random knorm --budgets 64 256 --page-sizes 1 16
    python -m sgl_vtoken_tools matrix --render-only     # redraw the section from the committed JSON lines

Launches SGLang itself (CPU, `sgl_vtoken_tools.launcher`), plays the synthetic agent workload
(`sgl_vtoken_tools.bench.agent`, speed only) against it for every cell (mode x policy x budget x
page size) and repeat (`sgl_vtoken_tools.bench.matrix` says how servers, cells, runs and repeats
are organised), then writes

- every run's JSON lines, tagged with cell, repeat and run, plus the fairness checks and the cells'
  figure spreads, to `--jsonl` (default docs/results/bench_agent.jsonl, committed next to
  docs/results/agent-benchmark.md; a `--quick` run writes into `--raw-dir` instead);
- from that file alone: the section between `<!-- bench:begin -->` and `<!-- bench:end -->` of
  `--results-md` (appended at the end when missing; nothing else in the file changes) and the
  plots `bench_*.png` in `--img-dir` (`sgl_vtoken_tools.bench.report`, `plots`);
- per-run JSON lines and the server logs in `--raw-dir`.

Fairness: every mode plays the same workload with the same request ids (so a seeded policy evicts
the same victims); the run checks that Naive-Evict and vToken returned identical outputs and
evicted the same number of tokens, and reports it with the cached prompt tokens of each. It exits
with status 3 (after writing everything) when outputs or evicted tokens differ.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import time
from pathlib import Path

from sgl_vtoken_tools.bench.cells import figure_spread
from sgl_vtoken_tools.bench.checks import fair, fairness_checks
from sgl_vtoken_tools.bench.machine import loadavg_text
from sgl_vtoken_tools.bench.matrix import MatrixConfig, MatrixRun
from sgl_vtoken_tools.bench.raw import RawLog
from sgl_vtoken_tools.bench.report import ROWS, publish
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO

DEFAULT_JSONL = REPO / "docs" / "results" / "bench_agent.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, __name__)
    p.add_argument(
        "--model-path", default=None, help="default: the tiny model in .cache/tiny-llama"
    )
    p.add_argument("--pool", type=int, default=4096, help="--max-total-tokens of every server")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[16])
    p.add_argument("--policies", nargs="+", default=["streamingllm", "random"])
    p.add_argument("--budgets", type=int, nargs="+", default=[128])
    p.add_argument("--interval", type=int, default=16, help="--kv-evict-interval")
    p.add_argument("--sink", type=int, default=4, help="--kv-sink")
    p.add_argument(
        "--server-per-cell", action="store_true", help="one server per cell with server-wide flags"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of every cell (the tables show their spread)"
    )
    common.numbers(
        p,
        sessions=8,
        turns=4,
        system_tokens=256,
        user_tokens=40,
        tool_tokens=300,
        tool_min=32,
        tool_max=1024,
        reply_tokens=32,
        seed=0,
    )
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0],
        help="Poisson session rates of the SLA ladder",
    )
    p.add_argument(
        "--sla-factors",
        type=float,
        nargs="+",
        default=[1.05, 2.0],
        help="SLA: p95 TTFT within factor x the unloaded p95 (1.05: the vToken paper's)",
    )
    p.add_argument(
        "--deadline-min",
        type=float,
        default=40.0,
        help="skip the remaining ladder rates once this many minutes have passed",
    )
    common.numbers(p, baseline_sessions=2, sample_interval=0.15)
    p.add_argument(
        "--quick", action="store_true", help="2 sessions x 2 turns, burst run only (smoke)"
    )
    p.add_argument(
        "--jsonl",
        type=Path,
        default=None,
        help=f"raw JSON lines of the run (default {DEFAULT_JSONL.relative_to(REPO)})",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="no servers: render --results-md and the plots from --jsonl",
    )
    p.add_argument(
        "--results-md", type=Path, default=REPO / "docs" / "results" / "agent-benchmark.md"
    )
    p.add_argument("--img-dir", type=Path, default=REPO / "docs" / "img")
    p.add_argument("--raw-dir", type=Path, default=REPO / ".cache" / "bench")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args, model: str) -> MatrixConfig:
    return common.from_args(MatrixConfig, args, model=str(model), progress=not args.no_progress)


def report_checks(checks: list[dict]) -> int:
    bad = [c for c in checks if not fair(c)]
    for c in bad:
        print(
            f"FAIRNESS CHECK FAILED: {c['policy']} b{c['budget']} ps{c['page']}: {c['identical']}/{c['requests']} "
            f"outputs identical, {c['unpaired']} unpaired, evicted tokens equal in {c['evicted_equal']}/{c['runs']} "
            f"runs, first difference {c['first_difference']}",
            file=sys.stderr,
        )
    return 3 if bad else 0


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(words)
    # SIGTERM (e.g. a job runner's timeout) unwinds like Ctrl-C, so every server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.sessions, args.turns = 2, 2
    jsonl = args.jsonl or (args.raw_dir / "bench_agent.jsonl" if args.quick else DEFAULT_JSONL)
    if args.render_only:
        return report_checks(publish(jsonl, args.results_md, args.img_dir, REPO))
    if args.model_path is None:
        from sgl_vtoken_tools.tiny_model import ensure_tiny_model

        model, model_name = (
            ensure_tiny_model(REPO / ".cache" / "tiny-llama"),
            "tiny-llama (sgl_vtoken_tools.tiny_model, random weights)",
        )
    else:
        model, model_name = args.model_path, args.model_path
    try:
        cfg = config_from_args(args, model)
    except ValueError as e:
        parser.error(f"--{str(e).split(' ', 1)[0].replace('_', '-')}: {e}")
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    raw = RawLog(jsonl)
    raw.line(
        {
            "kind": "matrix",
            "command": "make bench"
            if not words
            else "python -m sgl_vtoken_tools matrix " + " ".join(words),
            "date": datetime.date.today().isoformat(),
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
            "load_start": loadavg_text(),
            "model": model_name,
            "settings": cfg.settings(),
        }
    )
    run = MatrixRun(cfg, raw, args.raw_dir)
    cells = run.run()
    for check in fairness_checks(cells):
        raw.line(check)
    for c in cells:
        raw.line(
            {
                "kind": "cell",
                "cell": c.name,
                "mode": c.mode,
                "policy": c.policy,
                "budget": c.budget,
                "page": c.page,
                "repeats": len(c.repeats),
                "skipped_rates": c.skipped,
                "burst": {key: figure_spread(c, key) for _, key, _ in ROWS},
            }
        )
    raw.line(
        {
            "kind": "matrix_end",
            "elapsed_min": (time.monotonic() - t_start) / 60,
            "load_end": loadavg_text(),
            "servers": "; ".join(run.servers_described),
            "system_prompt_tokens": cells[0].repeats[0]["burst"]["summary"]["system_prompt_tokens"],
        }
    )
    raw.close()
    checks = publish(jsonl, args.results_md, args.img_dir, REPO)
    print(
        f"wrote {jsonl}, {args.results_md} and the plots in {args.img_dir} "
        f"in {(time.monotonic() - t_start) / 60:.1f} min",
        file=sys.stderr,
    )
    return report_checks(checks)
