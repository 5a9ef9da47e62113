"""Agent sessions: seeded, the system prompt shared, the key stated once where the metadata says
(the task or one line of the first tool output) and asked for last, the only 5-digit number of
the session; tool outputs and turn counts within their ranges; the splits kept apart."""

import json
import re

import pytest

from sgl_vtoken_tools.quality import agent_sessions as ag
from sgl_vtoken_tools.quality.splits import DEPTHS, PHRASINGS, split_sentences


def sessions(tok, wheel_dir, split="heldout", num=8, seed=0, **kw):
    return ag.agent_sessions(tok, ag.AgentSpec(split, num, seed=seed, **kw), wheel_dir)


def test_seeded_and_prefix_stable(tiny_tok, wheel_dir):
    a = sessions(tiny_tok, wheel_dir)
    assert a == sessions(tiny_tok, wheel_dir)
    assert a[:3] == sessions(tiny_tok, wheel_dir, num=3)  # session i does not depend on num
    other = sessions(tiny_tok, wheel_dir, seed=1)
    assert [s.answer for s in a] != [s.answer for s in other]
    assert len({s.id for s in a}) == len(a) and len({s.answer for s in a}) == len(a)


@pytest.mark.parametrize("split", ["tuning", "heldout", "final"])
def test_fact_stated_once_where_meta_says_and_asked_last(tiny_tok, wheel_dir, split):
    questions = {p.name: p for p in PHRASINGS[split]}
    for i, s in enumerate(sessions(tiny_tok, wheel_dir, split)):
        ph = questions[s.meta["phrasing"]]
        fact = ph.fact.format(key=s.answer)
        assert re.fullmatch(r"\d{5}", s.answer)
        assert s.meta["fact_turn"] == 1 + i % 2
        assert [t[0] for t in s.turns] == ["user"] + ["tool"] * (len(s.turns) - 2) + ["user"]
        stated = [k + 1 for k, (_, text) in enumerate(s.turns) if s.answer in text]
        assert stated == [s.meta["fact_turn"]], (s.id, stated)
        where = s.turns[s.meta["fact_turn"] - 1][1]
        assert where.count(fact) == 1 and where.count(s.answer) == ph.fact.count("{key}")
        assert s.turns[-1] == ("user", ph.question)
        # the key is the session's only 5-digit number, so the first number scored is unambiguous
        everything = ag.SYSTEM + "".join(text for _, text in s.turns)
        assert set(re.findall(r"(?<!\d)\d{5}(?!\d)", everything)) == {s.answer}
        assert not re.search(r"\d{6}", everything)
        if s.meta["fact_turn"] == 2:  # one whole line of the first tool output, at the depth
            lines = where.split("\n")[1:]
            at = [k for k, line in enumerate(lines) if fact in line]
            assert len(at) == 1 and s.meta["depth"] in DEPTHS[split]
            assert at[0] == round(s.meta["depth"] * (len(lines) - 1))
        else:
            assert s.turns[0][1].endswith(fact) and s.meta["depth"] is None


def test_lengths_in_range(tiny_tok, wheel_dir):
    for s in sessions(tiny_tok, wheel_dir, num=6):
        assert 8 <= len(s.turns) <= 10
        bodies = [text.split("\n", 1)[1] for role, text in s.turns if role == "tool"]
        n = [len(tiny_tok(b, add_special_tokens=False)["input_ids"]) for b in bodies]
        assert n == s.meta["tool_tokens"] and all(200 <= k <= 600 for k in n), n
        assert len(set(s.meta["kinds"])) == len(ag.KINDS)  # every kind of tool output
        records = [t for role, t in s.turns if t.startswith("Output of query_records")]
        for t in records:  # the records are JSON, one per line
            assert all(json.loads(line)["note"] for line in t.split("\n")[1:])
    short = sessions(tiny_tok, wheel_dir, num=4, turns=(3, 4), tool_tokens=(80, 160))
    assert all(3 <= len(s.turns) <= 4 for s in short)
    assert all(80 <= k <= 160 for s in short for k in s.meta["tool_tokens"])


def test_system_prompt_shared_and_splits_apart(tiny_tok, wheel_dir):
    tools = json.loads(ag.SYSTEM.split("Tools:\n", 1)[1])
    assert [t["function"]["name"] for t in tools] == [
        "run_shell",
        "search_code",
        "list_files",
        "query_records",
    ]
    tune = sessions(tiny_tok, wheel_dir, "tuning", num=4)
    held = sessions(tiny_tok, wheel_dir, "heldout", num=4)
    held_text = "".join(t for s in held for _, t in s.turns)
    tune_sents = set(split_sentences("tuning", wheel_dir))
    assert not set(ag.TASKS["tuning"]) & set(ag.TASKS["heldout"])
    assert {s.turns[0][1].split(" The ")[0] for s in tune} <= set(ag.TASKS["tuning"])
    assert not any(sent.strip() in held_text for sent in tune_sents if len(sent) > 40)
    assert {s.meta["phrasing"] for s in tune} <= {p.name for p in PHRASINGS["tuning"]}


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"split": "test"}, "split 'test'"),
        ({"num": 0}, "num"),
        ({"turns": (2, 9)}, "turns"),
        ({"turns": (9, 8)}, "turns"),
        ({"tool_tokens": (300, 200)}, "tool_tokens"),
    ],
)
def test_spec_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        ag.AgentSpec(**kw)
