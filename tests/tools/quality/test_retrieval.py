"""The dense retrieval tasks: the splits share no key word, filler or phrasing; every trial
states its value once, where its span says, asks for its key last, and is the same for the
same seed; an answer is whole, a strict prefix, another number or none."""

import re

import pytest

from sgl_vtoken_tools.quality import retrieval
from sgl_vtoken_tools.quality.retrieval import value_outcome


def test_the_splits_share_no_word_filler_or_phrasing():
    from itertools import combinations

    for a, b in combinations(("tuning", "heldout", "final"), 2):
        assert not set(retrieval.WORDS[a]) & set(retrieval.WORDS[b])
        for table in (retrieval.KV, retrieval.NEEDLE):
            assert table[a][0] != table[b][0] and table[a][2] != table[b][2]
        assert retrieval.NEEDLE[a][1] != retrieval.NEEDLE[b][1]
    with pytest.raises(ValueError, match="split 'test'"):
        retrieval.kv_trials(None, "test", [100])


@pytest.mark.parametrize("split", ["tuning", "heldout", "final"])
@pytest.mark.parametrize("make", [retrieval.kv_trials, retrieval.needle_trials])
def test_each_trial_states_its_value_once_and_asks_for_it_last(tiny_tok, split, make):
    a = make(tiny_tok, split, [200, 400], per_length=5, seed=1)
    assert a == make(tiny_tok, split, [200, 400], per_length=5, seed=1)
    assert [t.answer for t in a] != [t.answer for t in make(tiny_tok, split, [200], 5, seed=2)]
    assert len(a) == 10 and len({t.id for t in a}) == 10
    words = set(retrieval.WORDS[split])
    for t in a:
        text = tiny_tok.decode(list(t.prompt))
        lo, hi = t.span
        fact = tiny_tok.decode(list(t.prompt[lo:hi]))
        assert len(t.answer) == 7 and t.answer.isdigit()
        assert text.count(t.answer) == 1 and t.answer in fact
        pattern = r"([a-z ]+)(?::| =) \d" if t.task == "kv" else r"for ([a-z ]+) is:? \d"
        key = re.search(pattern, fact).group(1).strip()
        assert set(key.split()) <= words and 2 <= len(key.split()) <= 3
        q = t.meta["question_at"]
        assert hi <= q and key in tiny_tok.decode(list(t.prompt[q:]))
        assert t.meta["split"] == split and t.meta["prompt_tokens"] == len(t.prompt)
    if make is retrieval.kv_trials:  # a list of distinct keys, one per line
        lines = [m for ln in a[0].user.splitlines() if (m := re.fullmatch(r"(.+)(?::| =) \d+", ln))]
        assert len(lines) == a[0].meta["lines"] == len({m.group(1) for m in lines})


def test_only_the_whole_value_is_exact():
    assert value_outcome("The value of x is 9011417.", "9011417") == "exact"
    assert value_outcome("The value of x is 901.", "9011417") == "prefix"
    assert value_outcome("It is 90114170", "9011417") == "other"
    assert value_outcome("It is 1234567", "9011417") == "other"
    assert value_outcome("I do not know.", "9011417") == "none"
