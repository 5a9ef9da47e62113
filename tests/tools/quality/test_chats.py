"""Chat-shaped recall conversations: the key stated once where the group says (turn 1 alone, or
inside turn 2's passage), three passages in all around it, the split's question last; the same
arguments give the same conversation."""

import pytest

from sgl_vtoken_tools.quality import chats, splits


@pytest.mark.parametrize("split", splits.SPLITS)
def test_the_key_is_stated_once_where_the_group_says_and_asked_last(tiny_tok, wheel_dir, split):
    first = chats.chat_trials(tiny_tok, split, "first", 3, wheel_dir=wheel_dir)
    mid = chats.chat_trials(tiny_tok, split, "mid", 3, wheel_dir=wheel_dir)
    assert first == chats.chat_trials(tiny_tok, split, "first", 3, wheel_dir=wheel_dir)
    assert mid[:2] == chats.chat_trials(tiny_tok, split, "mid", 2, wheel_dir=wheel_dir)
    questions = {p.question for p in splits.PHRASINGS[split]}
    for t in first + mid:
        assert len(t.answer) == 5 and t.answer.isdigit() and len(t.messages) == 4
        assert t.messages[-1] in questions and t.answer not in t.messages[-1]
        assert all(m.startswith("Summarize this passage:") for m in t.messages[:-1])
        told = [tiny_tok.decode(list(t.prompt))] + list(t.messages)
        where = [i for i, text in enumerate(told) if t.answer in text]
        assert where == ([0] if t.meta["group"] == "first" else [1])
        if t.meta["group"] == "first":
            lo, hi = t.span
            assert tiny_tok.decode(t.prompt[lo:hi]).count(t.answer) == 2
        else:
            assert t.span == (0, 0) and t.user.startswith("Summarize this passage:")
    with pytest.raises(ValueError, match="group 'last'"):
        chats.chat_trials(tiny_tok, split, "last", 1, wheel_dir=wheel_dir)
