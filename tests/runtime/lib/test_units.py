"""Span-aware keeping (`sgl_vtoken.units`, `selection.select` with units) against the
independent definition in `tests/runtime/oracles/units.py`."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.units import keep_whole_units, unit_starts

from sgl_vtoken.selection import select
from sgl_vtoken.units import Words

TEXTS = ["sil", "ver", " garden", ":", " ", "9", "0", "1", "1", "4", "1", "7", "."]
VOCAB = ["a", "bc", " d", " ef", "1", "23", " 4", ".", ", ", ":", " ", "\n", "x9", "7y", "", "é"]


def test_a_number_is_one_unit_and_a_long_one_is_cut_at_the_span():
    words = Words(TEXTS)
    ids = list(range(len(TEXTS)))
    assert words.unit_starts(ids, 8).tolist() == [0, 0, 2, 3, 4, 5, 5, 5, 5, 5, 5, 5, 12]
    assert words.unit_starts(ids, 4).tolist() == [0, 0, 2, 3, 4, 5, 5, 5, 5, 9, 9, 9, 12]
    assert words.unit_starts(ids, 1).tolist() == ids


def test_bad_ids_and_spans_are_refused():
    words = Words(TEXTS)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 13\)"):
        words.unit_starts([0, 13], 4)
    with pytest.raises(ValueError, match="span must be >= 1"):
        words.unit_starts([0], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(VOCAB) - 1), max_size=60), st.integers(1, 9))
def test_units_follow_the_definition(ids, span):
    want = unit_starts([VOCAB[i] for i in ids], span)
    assert Words(VOCAB).unit_starts(ids, span).tolist() == want


@st.composite
def rows(draw):
    """Rows of a batch: scores (ties, NaN), protected entries, budgets, units (runs of equal
    ids, and some ids again further on, as a recalling turn's row holds them)."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 40))
        scores = draw(
            st.lists(st.sampled_from([0.0, 1.0, 2.0, 0.5, math.nan]), min_size=n, max_size=n)
        )
        protected = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        protected = [p and draw(st.integers(0, 4)) == 0 for p in protected]
        joins = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        units, start = [], 0
        for i, j in enumerate(joins):
            start = start if j and i else 3 * i
            units.append(start)
        if n > 2 and draw(st.booleans()):  # a few entries named like earlier units, at the end
            tail = draw(st.integers(1, n // 2))
            units[-tail:] = draw(
                st.lists(st.sampled_from(units[:-tail]), min_size=tail, max_size=tail)
            )
        budget = draw(st.integers(sum(protected), n + 2))
        out.append((scores, protected, budget, units))
    return out


@settings(max_examples=300, deadline=None)
@given(rows())
def test_select_keeps_whole_units_as_the_definition(batch):
    """The batched rule (every row at once, padded) keeps what the per-row definition keeps,
    and no unit it keeps is kept in part except for its protected entries."""
    w = max(len(r[0]) for r in batch)
    pad = lambda xs, fill: [x + [fill] * (w - len(x)) for x in xs]  # noqa: E731
    scores = torch.tensor(pad([r[0] for r in batch], 0.0), dtype=torch.float64)
    must = torch.tensor(pad([r[1] for r in batch], False))
    units = torch.tensor(pad([r[3] for r in batch], 0))
    lengths = torch.tensor([len(r[0]) for r in batch])
    budget = torch.tensor([r[2] for r in batch])
    keep = select(scores, must, budget, lengths, units).keep
    for b, (sc, prot, bud, un) in enumerate(batch):
        want = keep_whole_units(sc, prot, bud, un) if len(sc) > bud else list(range(len(sc)))
        got = keep[b].nonzero().flatten().tolist()
        if len(sc) <= bud:
            assert got == want
            continue
        assert got == want, (b, sc, prot, bud, un)
        assert len(got) <= bud
        kept = set(got)
        for i in got:
            mates = [j for j in range(len(un)) if un[j] == un[i]]
            assert prot[i] or all(j in kept for j in mates)


def test_a_value_the_budget_cuts_is_dropped_not_truncated():
    """The budget ends inside a 7-digit value: the value goes whole (the row keeps fewer than
    the budget, here nothing), where token by token its first digits would stay."""
    words = Words(TEXTS)
    units = words.unit_starts(list(range(len(TEXTS))), 8)
    scores = torch.tensor([0, 0, 0, 0, 0, 9, 8, 7, 6, 5, 4, 3, 0], dtype=torch.float64)
    n = torch.tensor([len(TEXTS)])
    plain = select(scores[None], torch.zeros(1, 13, dtype=torch.bool), torch.tensor([4]), n)
    assert plain.keep[0].nonzero().flatten().tolist() == [5, 6, 7, 8]
    spans = select(
        scores[None], torch.zeros(1, 13, dtype=torch.bool), torch.tensor([4]), n, units[None]
    )
    assert spans.keep[0].nonzero().flatten().tolist() == []
    whole = select(
        scores[None], torch.zeros(1, 13, dtype=torch.bool), torch.tensor([8]), n, units[None]
    )
    assert whole.keep[0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
