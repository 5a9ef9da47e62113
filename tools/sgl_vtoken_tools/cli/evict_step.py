"""The eviction step, batched against per row, on an SGLang-shaped fake pool (no SGLang).

    python -m sgl_vtoken_tools evict-step                        # CUDA: 8B and SmolLM2 shapes, bf16
    python -m sgl_vtoken_tools evict-step --device cpu           # CPU: SmolLM2 shapes, small rows
    python -m sgl_vtoken_tools evict-step --summarize run.jsonl  # the table of an earlier run
    python -m sgl_vtoken_tools evict-step --full --device cpu    # the whole step (needs SGLang)

For every shape x policy x interval x batch, both paths evict the same rows of `budget +
interval` tokens down to `budget` (`sgl_vtoken_tools.bench.evict_step`): one JSON line per path with
the median, min and max step time over `--repeats`, host synchronizations (CUDA's sync debug
mode; null on CPU), repack launches, moved tokens and bytes; the batched line adds
`speedup_vs_per_row`. A failing case is recorded as an `error` line and the run goes on.

With `--full`, the whole step a server adds at the trigger instead, through the real `patches/`
code on a server-shaped fake (`sgl_vtoken_tools.bench.full_step`: decode scoring of every layer,
then the eviction hook with tree work, history release and offload), per shape x policy x case
(`plain`, `history`, `history+offload`) x pool size x batch: one `evict_step_full` line each,
with the device work of one step counted on the way (`host_syncs`, `score_launches`, ...).
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
    p.add_argument(
        "--full", action="store_true", help="the whole step on a server-shaped fake (needs SGLang)"
    )
    p.add_argument("--pools", default="4096,1048576", help="--full: pool sizes in tokens")
    p.add_argument(
        "--cases",
        default="history+offload",
        help="--full: comma list of plain, history, history+offload",
    )
    args = p.parse_args(argv)
    if args.full:
        from sgl_vtoken_tools.bench.full_step import SHAPES as FULL_SHAPES

        args.shapes = args.shapes if args.shapes != p.get_default("shapes") else "llama8b"
        for name in args.shapes.split(","):
            if name not in FULL_SHAPES:
                p.error(
                    f"--shapes: unknown shape {name!r} for --full; choose from {sorted(FULL_SHAPES)}"
                )
        return args
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


def full(args) -> list[dict]:
    """`--full`: one `evict_step_full` line per case (printed, and written to `--out`)."""
    from sgl_vtoken_tools.bench.full_step import measure_full
    from sgl_vtoken_tools.step_counts import Scenario

    log = _log(args.out)
    grid = product(_words(args.shapes), _words(args.policies), _words(args.cases))
    for (shape, policy, case), pool, batch in product(grid, _ints(args.pools), _ints(args.batches)):
        sc = Scenario(
            policy,
            args.page_size,
            history="history" in case,
            offload="offload" in case,
            batch=batch,
            pool_tokens=pool,
            budget=64,
            interval=16,
        )
        try:
            line = measure_full(sc, shape, args.repeats)
        except Exception as e:  # one case failing must not lose the others
            line = dict(
                bench="evict_step_full",
                shape=shape,
                policy=policy,
                case=case,
                pool_tokens=pool,
                batch=batch,
                error=f"{type(e).__name__}: {e}",
            )
        log.emit(line)
    return log.records


def _words(text: str) -> list[str]:
    return text.split(",")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _log(path: str) -> RunLog:
    """The run's lines: printed as they come, and written to `path` too (unless "-")."""
    return RunLog(None if path == "-" else path, echo=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.full:
        full(args)
        return 0
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
