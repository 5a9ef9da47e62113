"""The eviction step, batched against per row, on an SGLang-shaped fake pool (no SGLang).

    python -m sgl_vtoken_tools evict-step                        # CUDA: 8B and SmolLM2 shapes, bf16
    python -m sgl_vtoken_tools evict-step --device cpu           # CPU: SmolLM2 shapes, small rows
    python -m sgl_vtoken_tools evict-step --summarize run.jsonl  # the table of an earlier run

For every shape x policy x interval x batch, both paths evict the same rows of `budget +
interval` tokens down to `budget` (`sgl_vtoken_tools.bench.evict_step`): one JSON line per path with
the median, min and max step time over `--repeats`, host synchronizations (CUDA's sync debug
mode; null on CPU), repack launches, moved tokens and bytes; the batched line adds
`speedup_vs_per_row`. A failing case is recorded as an `error` line and the run goes on.
"""

from __future__ import annotations

import sys
import time
from itertools import product

import torch

from sgl_vtoken_tools.bench.evict_step import POLICIES, SHAPES, Case, measure
from sgl_vtoken_tools.bench.jsonl import RunLog
from sgl_vtoken_tools.cli import common

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = common.parser(__doc__, __name__)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument(
        "--shapes",
        default="llama8b,smollm2" if cuda else "smollm2",
        help=f"comma list of {sorted(SHAPES)}",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--batches", default="1,16,64,256" if cuda else "1,16,64")
    p.add_argument("--budget", type=int, default=2048 if cuda else 512)
    p.add_argument("--intervals", default="1,16")
    common.numbers(p, page_size=16, repeats=5)
    p.add_argument(
        "--deadline-s", type=float, default=float("inf"), help="skip cases that would start later"
    )
    p.add_argument("--out", default="-", help="JSONL path ('-' = stdout only)")
    p.add_argument("--summarize", metavar="JSONL", help="only print the table of an earlier run")
    args = p.parse_args(argv)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            p.error(f"--shapes: unknown shape {name!r}; choose from {sorted(SHAPES)}")
    for name in args.policies.split(","):
        if name not in POLICIES:
            p.error(f"--policies: unknown policy {name!r}; choose from {list(POLICIES)}")
    return args


def summarize(lines: list[dict]) -> str:
    rows = [
        "| shape | policy | interval | batch | batched ms | per-row ms | speedup | syncs | launches |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    per_row = {
        (x["shape"], x["policy"], x["interval"], x["batch"]): x
        for x in lines
        if x.get("path") == "per_row"
    }
    for x in lines:
        if x.get("path") != "batched":
            continue
        key = (x["shape"], x["policy"], x["interval"], x["batch"])
        y = per_row.get(key, {})
        rows.append(
            f"| {x['shape']} | {x['policy']} | {x['interval']} | {x['batch']} | {x['ms_median']} | "
            f"{y.get('ms_median')} | {x['speedup_vs_per_row']}x | {x['host_syncs']} vs {y.get('host_syncs')} | "
            f"{x['repack_launches']} vs {y.get('repack_launches')} |"
        )
    return "\n".join(rows)


def _words(text: str) -> list[str]:
    return text.split(",")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _log(path: str) -> RunLog:
    """The run's lines: printed as they come, and written to `path` too (unless "-")."""
    return RunLog(None if path == "-" else path, echo=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.summarize:
        print(summarize(common.read_lines(args.summarize)))
        return 0
    log, start = _log(args.out), time.monotonic()
    grid = product(_words(args.shapes), _words(args.policies), _ints(args.intervals))
    for (shape, policy, interval), batch in product(grid, _ints(args.batches)):
        case = Case(
            shape,
            DTYPES[args.dtype],
            args.device,
            policy,
            batch,
            args.budget,
            interval,
            args.page_size,
        )
        if time.monotonic() - start > args.deadline_s:
            got = [dict(bench="evict_step", skipped="deadline", **_key(case))]
        else:
            try:
                got = measure(case, args.repeats)
            except Exception as e:  # one case failing must not lose the others
                got = [dict(bench="evict_step", error=f"{type(e).__name__}: {e}", **_key(case))]
            finally:
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        for line in got:
            log.emit(line)
    print(summarize(log.records), file=sys.stderr)
    return 0


def _key(case: Case) -> dict:
    return dict(
        shape=case.shape,
        policy=case.policy,
        batch=case.batch,
        interval=case.interval,
        budget=case.budget,
        device=case.device,
    )
