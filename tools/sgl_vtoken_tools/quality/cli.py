"""What the quality command lines share: loading, JSON lines, servers.

    tok, model = load(path, threads)     torch's thread count set first (when threads > 0), then
                                         the tokenizer and the fast reference's model
                                         (:func:`sgl_vtoken_tools.quality.fastref.load_model`)
    with json_lines(path) as emit:       emit(record) writes one JSON line and flushes it; stdout
                                         when path is None, else the file, closed on the way out
    server_flags(args, pool, evict=...)  a fp32 CPU server of args.model, args.page_size; with
                                         `evict`, its --kv-* flags from args (budget, sink, ...)
    with served(flags) as client:        that server started, and stopped on the way out
    write_run(path, config, records, f)  the config line, the records as they come, f's summary
    hits_by(records, *keys)              summary lines: hits and trials per group of trials
    server_script_parser(doc, ...)       the flags the long_doc and long_chat scripts share

Used by ``python -m sgl_vtoken_tools quality`` and the quality CLIs (`chat_recall.py`, `chat_server.py`,
`long_doc.py`, `long_chat.py`). Torch and transformers are imported by :func:`load` only, so
``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from sgl_vtoken_tools.cli.common import numbers


def load(path: str, threads: int = 0):
    """(tokenizer, fast-reference model) of the folder `path`, after setting torch's threads."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.quality.fastref import load_model

    return AutoTokenizer.from_pretrained(path), load_model(path)


SMOLLM2 = ".cache/smollm2"


def server_tokenizer(path: str):
    """The tokenizer of the folder `path` a server script serves; the default SmolLM2 folder is
    built first if missing (`models.ensure_model`)."""
    from transformers import AutoTokenizer

    from sgl_vtoken_tools.models import ensure_model

    if path == SMOLLM2:
        ensure_model("smollm2", path)
    return AutoTokenizer.from_pretrained(path)


def server_script_parser(doc: str, pool_help: str, sink: int) -> argparse.ArgumentParser:
    """The flags the server scripts (`long_doc.py`, `long_chat.py`) share: the model, the split,
    the evicting server's pool and eviction flags (`sink` its default), prefill chunk, answer
    length, seed and output file."""
    from sgl_vtoken_tools.quality.splits import SPLITS

    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--split", choices=SPLITS, required=True)
    ap.add_argument("--pool", type=int, default=1024, help=pool_help)
    numbers(ap, page_size=1, budget=256)
    ap.add_argument("--sink", type=int, default=sink)
    numbers(ap, interval=16, prefill_chunk=64, max_new=24, seed=0)
    ap.add_argument("--out", default=None)
    return ap


def write_run(path: str | None, config: dict, records: Iterable[dict], summary) -> None:
    """The server scripts' output (`json_lines` on `path`): a `config` line with `config`, each
    of `records` as it comes (a lazy iterable plays as it is written), then the lines of
    ``summary(records)``."""
    done: list[dict] = []
    with json_lines(path) as emit:
        emit({"kind": "config", **config})
        for r in records:
            done.append(r)
            emit(r)
        for line in summary(done):
            emit(line)


@contextmanager
def json_lines(path: str | None) -> Iterator[Callable[[dict], None]]:
    """A function writing one record per line to `path` (stdout when None), flushed each time."""
    out = open(path, "w") if path else sys.stdout

    def emit(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    try:
        yield emit
    finally:
        if out is not sys.stdout:
            out.close()


def server_flags(args, pool: int, evict: str | None = None, config: dict | None = None) -> list:
    """Flags of a fp32 CPU server of ``args.model`` at ``args.page_size`` with a pool of `pool`
    tokens; with `evict` (a policy), ``--kv-evict`` and its budget, sink, window (when `args` has
    one) and interval from `args`, the overlap scheduler off (eviction during prefill needs it),
    and `config` as ``--kv-evict-config``."""
    from sgl_vtoken_tools.launcher import cpu_server_args

    flags = cpu_server_args(args.model, pool, args.page_size) + ["--dtype", "float32"]
    if evict is None:
        return flags
    flags += ["--disable-overlap-schedule", "--kv-evict", evict, "--kv-budget", str(args.budget)]
    flags += ["--kv-sink", str(args.sink), "--kv-evict-interval", str(args.interval)]
    if getattr(args, "window", None) is not None:
        flags += ["--kv-window", str(args.window)]
    return flags + ["--kv-evict-config", json.dumps(config or {})]


def hits_by(records: list[dict], *keys: str, ordered: bool = False) -> list[dict]:
    """A `summary` line of hits and trials per distinct value of `keys` in the trial `records`,
    first seen first (`ordered`: sorted)."""
    acc: dict[tuple, list[int]] = {}
    for r in records:
        hits = acc.setdefault(tuple(r[k] for k in keys), [0, 0])
        hits[0] += int(r["hit"])
        hits[1] += 1
    groups = sorted(acc.items()) if ordered else acc.items()
    return [
        {"kind": "summary", **dict(zip(keys, g)), "hits": h, "trials": n} for g, (h, n) in groups
    ]


@contextmanager
def served(flags: list) -> Iterator:
    """A `server_check.Client` of a server started with `flags`, stopped on the way out."""
    from sgl_vtoken_tools.launcher import ServerProcess
    from sgl_vtoken_tools.quality.server_check import Client

    server = ServerProcess(flags).start()
    try:
        yield Client(server.base_url)
    finally:
        server.stop()
