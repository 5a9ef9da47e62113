"""Units: the words and digit runs a span-aware eviction keeps or drops whole.

A token continues the unit of the token before it when its text starts with a letter or digit
and the previous token's text ends with one; anything else (a leading space, punctuation, a
newline) opens a new unit. A unit longer than `span` tokens is cut into pieces of `span`::

    tokens   'sil' 'ver' ' garden' ':' ' ' '9' '0' '1' '1' '4' '1' '7' '.'
    units     0     0     2        3   4   5   5   5   5   5   5   5   12      (span >= 7)
    span 4    0     0     2        3   4   5   5   5   5   9   9   9   12

A unit is named by the position of its first token (`unit_starts`): the entries of a row that
share that name are one unit, wherever the row holds them (recalled entries come after the
rest). The table is read from the tokenizer once (:meth:`Words.from_tokenizer`); policies see
the unit of each entry in ``TokenView.units``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Tokenizer(Protocol):
    """What `Words.from_tokenizer` reads of a Hugging Face tokenizer."""

    def __len__(self) -> int: ...

    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


def _alnum(ch: str) -> bool:
    return ch.isalnum()


class Words:
    """Per vocabulary id: whether a token's text opens with, and closes with, a letter or digit.

    Args:
        texts: the decoded text of every vocabulary id, in id order.
    """

    def __init__(self, texts: Sequence[str]) -> None:
        if not len(texts):
            raise ValueError("Words needs the text of at least one vocabulary id")
        self.opens = torch.tensor([bool(t) and _alnum(t[0]) for t in texts], dtype=torch.bool)
        self.closes = torch.tensor([bool(t) and _alnum(t[-1]) for t in texts], dtype=torch.bool)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> Words:
        """The table of a Hugging Face tokenizer (one batched decode of the whole vocabulary)."""
        return cls(tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))

    @property
    def vocab_size(self) -> int:
        return self.opens.shape[0]

    def unit_starts(self, ids: torch.Tensor | Sequence[int], span: int) -> torch.Tensor:
        """``[n] int64``: for each token of the sequence `ids` ``[n]`` (position = index), the
        position of its unit's first token, units cut to at most `span` tokens (``span >= 1``).

        Raises:
            ValueError: an id outside the table, or `span` < 1.
        """
        if span < 1:
            raise ValueError(f"span must be >= 1 (got {span})")
        ids = torch.as_tensor(ids, dtype=torch.int64)
        n = ids.shape[0]
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}) (the tokenizer's vocabulary); "
                f"got [{int(ids.min())}, {int(ids.max())}]"
            )
        pos = torch.arange(n, dtype=torch.int64)
        joins = torch.zeros(n, dtype=torch.bool)
        joins[1:] = self.opens[ids[1:]] & self.closes[ids[:-1]]
        start = torch.where(joins, 0, pos).cummax(0).values
        return start + (pos - start) // span * span
