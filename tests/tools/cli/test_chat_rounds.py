"""tools/sgl_vtoken_tools/cli/chat.py without a server: its conversations (the key where the variant puts it,
disjoint splits, phrasings of its own), the scoring and leak detection, the cell figures and the
table, the pressure cell's flags and the command line's checks."""

import re

import pytest

from sgl_vtoken_tools.bench import chat_conversations as cc
from sgl_vtoken_tools.bench import chat_rounds as cr
from sgl_vtoken_tools.bench.server_cells import CELLS, CHAT
from sgl_vtoken_tools.quality import chats, splits


def sentences(text: str) -> list[str]:
    """Sentences and lines of `text`, lower-cased."""
    return [s.strip().lower() for s in re.split(r"(?<=[.!?:])\s+|\n+", text) if s.strip()]


@pytest.mark.parametrize("split", cc.SPLITS)
def test_key_in_turn_one(fake_essays, split):
    convs = cc.conversations(split, 4, "first", 3, seed=1, wheel_dir=fake_essays)
    assert len({c.key for c in convs}) == 4
    for c in convs:
        assert re.fullmatch(r"\d{5}", c.key) and c.key_turn == 1 and len(c.messages) == 5
        assert c.messages[0] in {s.format(key=c.key) for s in cc.STATEMENTS}
        assert [c.key in m for m in c.messages] == [True, False, False, False, False]
        assert c.messages[-1] in cc.QUESTIONS
        for m in c.messages[1:4]:
            ask, text = m.split("\n\n", 1)
            assert ask + "\n\n{text}" in cc.SUMMARIZE
            assert cc.PASSAGE_WORDS[0] <= len(text.split()) <= cc.PASSAGE_WORDS[1]


@pytest.mark.parametrize("split", cc.SPLITS)
def test_key_mid_passage_in_turn_two(fake_essays, split):
    convs = cc.conversations(split, 3, "passage", 3, seed=0, wheel_dir=fake_essays)
    for c in convs:
        assert c.key_turn == 2 and len(c.messages) == 5
        assert [c.key in m for m in c.messages] == [False, True, False, False, False]
        assert all(m.split("\n\n", 1)[0] + "\n\n{text}" in cc.SUMMARIZE for m in c.messages[:4])
        text = c.messages[1].split("\n\n", 1)[1]
        fact = cc.STATEMENTS[c.meta["statement"]].format(key=c.key)
        at = text.index(fact)
        # between the middle sentences: passage text on both sides, about as much
        before, after = len(text[:at].split()), len(text[at + len(fact) :].split())
        assert before > 40 and after > 40 and abs(before - after) < 60, (before, after)


def test_splits_share_no_passage_seed_or_conversation(fake_essays):
    texts = {s: set(cc.passages(s, fake_essays)) for s in cc.SPLITS}
    assert all(texts.values())
    for a in cc.SPLITS:
        for b in cc.SPLITS:
            if a < b:
                assert not texts[a] & texts[b], (a, b)
    ranges = sorted((cc.SEED_BASE[s], cc.SEED_BASE[s] + cc.SEEDS_PER_SPLIT) for s in cc.SPLITS)
    assert all(hi <= lo for (_, hi), (lo, _) in zip(ranges, ranges[1:]))
    # a conversation's passages are its split's, and no two conversations share one
    for s in cc.SPLITS:
        convs = cc.conversations(s, 5, "passage", 3, wheel_dir=fake_essays)
        used = [j for c in convs for j in c.meta["passages"]]
        assert len(used) == len(set(used)) == 20
        pool = cc.passages(s, fake_essays)
        for c in convs:
            for j, m in zip(c.meta["passages"], c.messages):
                assert " ".join(pool[j][:2]) in m


def test_conversation_i_does_not_depend_on_the_count(fake_essays):
    few = cc.conversations("heldout", 2, "first", 3, seed=7, wheel_dir=fake_essays)
    many = cc.conversations("heldout", 6, "first", 3, seed=7, wheel_dir=fake_essays)
    assert few == many[:2]
    other = cc.conversations("heldout", 2, "first", 3, seed=8, wheel_dir=fake_essays)
    assert [c.key for c in other] != [c.key for c in few]


def test_bad_arguments(fake_essays):
    with pytest.raises(ValueError, match="key_at"):
        cc.conversations("heldout", 1, "middle", wheel_dir=fake_essays)
    with pytest.raises(ValueError, match="seed"):
        cc.conversations("heldout", 1, seed=cc.SEEDS_PER_SPLIT, wheel_dir=fake_essays)
    with pytest.raises(ValueError, match="passages; the final split has"):
        cc.conversations("final", 500, wheel_dir=fake_essays)


def test_phrasings_are_not_those_of_the_chat_harness():
    theirs = {chats.FIRST, chats.SUMMARISE, splits.PASSAGE}
    for ph in splits.PHRASINGS.values():
        for p in ph:
            theirs |= {p.fact, p.question}
    key, text = "48213", "TEXT"
    their_sents = {s for t in theirs for s in sentences(t.format(key=key, fact="", text=text))}
    their_sents -= {text.lower()}
    for slot in (cc.STATEMENTS, cc.SUMMARIZE, cc.QUESTIONS):
        assert len(set(slot)) == len(slot) >= 4
        for mine in slot:
            filled = mine.format(key=key, text=text).lower()
            assert not set(sentences(filled)) & their_sents, mine
            assert not any(s in filled for s in their_sents if len(s) > 12), mine


def test_reply_key_and_leaks():
    assert cr.reply_key("The pass key is 48213.") == "48213"
    assert cr.reply_key("1234 then 482130 then 48213") == "48213"  # 4 and 6 digits are not keys
    assert cr.reply_key("no number") is None
    assert cr.foreign_keys("48213 and 11111, 22222", "48213", {"48213", "11111", "33333"}) == [
        "11111"
    ]
    assert cr.foreign_keys("111112", "48213", {"11111"}) == []


def request(conv: str, turn: int, reply: str, error=None, **kw) -> dict:
    rec = {
        "conversation": conv,
        "turn": turn,
        "reply": reply,
        "error": error,
        "prompt_tokens": 100 * turn,
        "cached_tokens": 80 * (turn - 1),
        "completion_tokens": 10,
        "latency": 0.5,
        "evicted_tokens": None,
        "evictions": None,
        "history_source": None,
    }
    return {**rec, **kw}


def convs3() -> list[cc.Conversation]:
    return [
        cc.Conversation(f"c{i}", key, "first", 1, ("a", "b", "q"))
        for i, key in enumerate(("11111", "22222", "33333"))
    ]


def test_score_answers_and_leaks():
    convs = convs3()
    reqs = [request(c.id, t, "ok") for c in convs for t in (1, 2)]
    reqs += [
        request("c0", 3, "It is 11111."),  # right
        request("c1", 3, "It is 33333, or 22222."),  # wrong and a leak of c2's key
        request("c2", 3, "", error="HTTP 500: boom"),  # failed
    ]
    reqs[0]["reply"] = "Noted: 22222"  # c0's first reply leaks c1's key
    answers = cr.score(convs, reqs)
    assert [a["hit"] for a in answers] == [True, False, False]
    assert [a["failed"] for a in answers] == [False, False, True]
    assert [a["leaks"] for a in answers] == [1, 1, 0]
    assert reqs[0]["leaked"] == ["22222"] and reqs[-2]["leaked"] == ["33333"]
    assert answers[1]["number"] == "33333"
    # a conversation that stopped before its last turn is a miss, even with the key in a reply
    short = cr.score(convs[:1], [request("c0", 1, "11111")])
    assert short[0]["failed"] and not short[0]["hit"] and short[0]["reply"] == ""


def test_cell_line_adds_up():
    convs = convs3()
    reqs = [
        request(c.id, t, "11111" if c.id == "c0" and t == 3 else "x", evicted_tokens=5 * t)
        for c in convs
        for t in (1, 2, 3)
    ]
    reqs[-1]["error"] = "HTTP 500"
    answers = cr.score(convs, reqs)
    log = "KV cache pool is full. Retract requests. #retracted_reqs: 2\nDecode batch, #running-req: 3,"
    c = cr.cell_line(answers, reqs, 4.0, [1.0, 1.5, 1.5], log, server_evicted=99)
    assert (c["answers"], c["conversations"], c["leaks"]) == (1, 3, 0)
    assert (c["requests"], c["failed"], c["output_tokens"]) == (9, 1, 80)
    assert c["output_tokens_per_s"] == 20.0
    sent = 3 * (100 + 200 + 300) - 300
    cached = 3 * (0 + 80 + 160) - 160
    assert (c["prompt_tokens_sent"], c["cached_tokens"]) == (sent, cached)
    assert c["prompt_tokens_computed"] == sent - cached
    assert c["evicted_tokens"] == 3 * (5 + 10 + 15) and c["server_evicted_tokens"] == 99
    assert (c["retractions"], c["peak_running"]) == (2, 3)
    # no report at all (stock, the full cache): evicted tokens unknown, not 0
    stock = cr.cell_line(answers, [request("c0", 1, "x", leaked=[])], 1.0, [1.0])
    assert stock["evicted_tokens"] is None and stock["retractions"] is None


def test_table_quotes_repeats():
    rows = [
        {
            "cell": "pressure",
            "key_at": "first",
            "mode": "rounds",
            "conversations": 12,
            "answers": a,
            "leaks": 0,
            "output_tokens_per_s": tps,
            "prompt_tokens_computed": 1000,
            "retractions": 0,
        }
        for a, tps in ((9, 30.0), (10, 32.0), (9, 31.0))
    ]
    md = cr.table(rows)
    assert (
        "| pressure | first | rounds | 3 | 28/36 (9-10) | 0 | 31.0 (30.0-32.0) | 1000 | 0 |" in md
    )


def test_pressure_cell_is_the_chat_command_under_the_pressure_trigger_with_prefill_chunk():
    import json

    pressure, chat = CELLS["pressure"], CELLS[CHAT]
    assert pressure[:-3] == chat[:-1] and pressure[-2:] == ["--kv-evict-trigger", "pressure"]
    assert json.loads(pressure[-3]) == {**json.loads(chat[-1]), "prefill_chunk": 64}


@pytest.mark.parametrize(
    "argv,flag",
    [
        (("--conversations", "0"), "--conversations"),
        (("--max-tokens", "0"), "--max-tokens"),
        (("--split", "test"), "--split"),
        (("--seed", "-1"), "--seed"),
        (("--cells", "nonesuch"), "--cells"),
        (("--base-url", "http://127.0.0.1:9", "--cells", "a={"), "--cells"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(command, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        command("chat").main(list(argv))
    assert e.value.code == 2 and flag in capsys.readouterr().err.splitlines()[-1]


def test_report_renders_a_run(command, tmp_path, capsys):
    import json

    path = tmp_path / "run.jsonl"
    cell = {
        "kind": "cell",
        "cell": "stock",
        "key_at": "passage",
        "mode": "one-at-a-time",
        "conversations": 2,
        "answers": 1,
        "leaks": 0,
        "output_tokens_per_s": 12.5,
        "prompt_tokens_computed": 300,
        "retractions": None,
    }
    path.write_text(json.dumps({"kind": "config"}) + "\n" + json.dumps(cell) + "\n")
    md = tmp_path / "t.md"
    assert command("chat").main(["--report", str(path), "--markdown", str(md)]) == 0
    assert "| stock | passage | one-at-a-time | 1 | 1/2 | 0 | 12.5 | 300 | - |" in md.read_text()
    assert md.read_text() in capsys.readouterr().out


def test_report_of_several_runs_takes_a_later_runs_cell_line(command, tmp_path, capsys):
    """`--report A B`: B's line of a (cell, repeat) replaces A's; A's other lines stay, every
    repeat of a file counted."""
    import json

    def line(cell, repeat, answers):
        return {
            "kind": "cell",
            "cell": cell,
            "repeat": repeat,
            "key_at": "first",
            "mode": "rounds",
            "conversations": 12,
            "answers": answers,
            "leaks": 0,
            "output_tokens_per_s": 10.0,
            "prompt_tokens_computed": 100,
            "retractions": 0,
        }

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = (line("stock", 0, 1), line("stock", 1, 2), line("pressure", 0, 3))
    a.write_text("\n".join(json.dumps(r) for r in first))
    b.write_text(json.dumps(line("stock", 0, 5)) + "\n")
    assert command("chat").main(["--report", str(a)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stock")]
    assert rows == ["| stock | first | rounds | 2 | 3/24 (1-2) | 0 | 10.0 | 100 | 0 | - |"]
    assert command("chat").main(["--report", str(a), str(b)]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith(("| stock", "| pr"))]
    assert rows == [
        "| stock | first | rounds | 2 | 7/24 (2-5) | 0 | 10.0 | 100 | 0 | - |",
        "| pressure | first | rounds | 1 | 3/12 | 0 | 10.0 | 100 | 0 | - |",
    ]
