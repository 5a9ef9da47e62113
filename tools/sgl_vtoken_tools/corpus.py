"""Text that ships with Python, as train and held-out token streams (tiny LM and KVP traces).

    corpus(text, heldout_every)     (train documents, held-out documents)
    tokenize(tok, docs)             one int64 stream, every document followed by the EOS token
    text_windows(model, text, split, num, seq_len, seed, heldout_every)
                                    [num, seq_len] seeded windows of one split, tokenized by the
                                    model folder's tokenizer

`text` is None or ``"stdlib"`` (the standard library's top-level ``.py`` files, sorted by name),
``"pydoc"`` (``pydoc_data.topics``: the language reference and library topics, English prose
with code examples), both split by whole documents (every `heldout_every`-th one held out), or
the path of a plain-text file (its last 10% held out). Nothing is downloaded; the same
arguments give the same documents and, with the same seed, the same windows.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def corpus(text: str | None, heldout_every: int) -> tuple[list[str], list[str]]:
    """(train documents, held-out documents) of `text` (see the module docstring)."""
    if text == "pydoc":
        from pydoc_data.topics import topics

        docs = [topics[name] for name in sorted(topics)]
    elif text in (None, "stdlib"):
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    else:
        body = Path(text).read_text(encoding="utf-8", errors="replace")
        cut = int(len(body) * 0.9)
        return [body[:cut]], [body[cut:]]
    return (
        [d for i, d in enumerate(docs) if i % heldout_every],
        [d for i, d in enumerate(docs) if i % heldout_every == 0],
    )


def tokenize(tok, docs: list[str]) -> torch.Tensor:
    """The documents' token ids end to end, each followed by ``tok.eos_token_id``."""
    ids: list[int] = []
    for d in docs:
        ids += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.int64)


def text_windows(
    model_path: str,
    text: str | None,
    split: str,
    num: int,
    seq_len: int,
    seed: int,
    heldout_every: int = 10,
) -> torch.Tensor:
    """``[num, seq_len]`` windows of the ``"train"`` or ``"heldout"`` split, at start offsets
    drawn from a generator seeded with `seed`."""
    from transformers import AutoTokenizer

    train_docs, held_docs = corpus(text, heldout_every)
    ids = tokenize(
        AutoTokenizer.from_pretrained(model_path), train_docs if split == "train" else held_docs
    )
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (num,), generator=gen).tolist()
    return torch.stack([ids[s : s + seq_len] for s in starts])
