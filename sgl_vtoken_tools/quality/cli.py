"""What the quality command lines share: the model, threads and output flags, loading, JSON lines.

    add_model_flags(parser)              --model (required), --threads (0: torch's default), --out
    tok, model = load(path, threads)     torch's thread count set first (when threads > 0), then
                                         the tokenizer and the fast reference's model
                                         (:func:`sgl_vtoken_tools.quality.fastref.load_model`)
    with json_lines(path) as emit:       emit(record) writes one JSON line and flushes it; stdout
                                         when path is None, else the file, closed on the way out

Used by ``scripts/check_fastref.py``, ``scripts/diag_attention.py`` and
``scripts/eval_quality.py``. Torch and transformers are imported by :func:`load` only, so
``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --threads and --out, as every quality script spells them."""
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", help="JSON lines file (default stdout)")


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
