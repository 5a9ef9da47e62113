"""The joint benchmark's client against one evicting test server: every conversation plants its
fact once and asks for it last, an answer is scored right exactly when its first number is the
fact's, every turn of every conversation is answered, request ids are fixed, the recorded scores
are the replies checked against the facts, and an evicting conversation holds at most its budget
(+ one interval) of device KV."""

import re

import pytest
from servers import BENCH_FLAGS

from sgl_vtoken_tools.bench import joint
from sgl_vtoken_tools.bench.probe import flush_cache

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]

BUDGET, INTERVAL = 64, 16  # the server's (BENCH_FLAGS)


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=BENCH_FLAGS)


def test_conversations_play_and_score(client, tiny_model, fake_essays):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    spec = joint.JointSpec(
        split="heldout",
        sessions=3,
        turns=3,
        passage_tokens=60,
        docqa=2,
        docqa_lengths=(200,),
        reply_tokens=8,
    )
    convs = joint.conversations(tok, spec, fake_essays)
    assert [c.task for c in convs] == ["session"] * 3 + ["docqa"] * 2
    for c in convs:  # the fact (its number) is stated in one message, never in the question
        assert re.fullmatch(r"\d{5}", c.answer)
        stated = [i + 1 for i, m in enumerate(c.messages) if c.answer in m]
        assert stated == [c.meta["fact_turn"] if c.task == "session" else 1], (c.id, stated)
        if c.task == "session":
            assert len(c.messages) == 3 and c.answer not in c.messages[-1]
    check_scoring(convs)
    model = client.get("/v1/models")["data"][0]["id"]
    runs = {}
    for name, kv in (
        ("full", {"policy": "none"}),
        ("evict", None),
    ):  # None: the server's streamingllm b64
        flush_cache(client.base_url)
        runs[name] = joint.play(client.base_url, model, convs, joint.Send(kv, name, 8))
    full_reqs, full_answers, _ = runs["full"]
    for name, (reqs, answers, wall) in runs.items():
        assert len(reqs) == 3 * 3 + 2 and all(r["error"] is None for r in reqs)
        assert {r["rid"] for r in reqs} == {
            f"{name}-{c.id}-t{t}" for c in convs for t in range(1, len(c.messages) + 1)
        }
        assert [a["conversation"] for a in answers] == [c.id for c in convs]
        # each recorded score is the returned reply checked against the conversation's fact
        for a, c in zip(answers, convs):
            assert a["expected"] == c.answer and not a["failed"]
            assert a["hit"] == right(a["reply"], c.answer), (c.id, a["reply"], c.answer)
        s = joint.summarize(reqs, answers, wall, None, full_answers)
        assert (
            s["failed"] == 0 and s["output_tokens"] == sum(r["completion_tokens"] for r in reqs) > 0
        )
        assert s["conversations"] == 5
        hits = [right(a["reply"], c.answer) for a, c in zip(answers, convs)]
        assert (s["accuracy"], s["accuracy_session"], s["accuracy_docqa"]) == (
            round(sum(hits) / 5, 4),
            round(sum(hits[:3]) / 3, 4),
            round(sum(hits[3:]) / 2, 4),
        )
        full_numbers = [number(a["reply"]) for a in full_answers]
        agree = [number(a["reply"]) == n for a, n in zip(answers, full_numbers)]
        assert s["agreement"] == round(sum(agree) / 5, 4)
        if name == "full":
            # the whole history: the last turn's prompt and reply
            last = {
                r["conversation"]: r
                for r in reqs
                if r["turn"]
                == max(x["turn"] for x in reqs if x["conversation"] == r["conversation"])
            }
            assert [a["kv_tokens"] for a in answers] == [
                last[c.id]["prompt_tokens"] + last[c.id]["completion_tokens"] for c in convs
            ]
        else:
            long = [
                r for r in reqs if r["prompt_tokens"] + r["completion_tokens"] >= BUDGET + INTERVAL
            ]
            assert len(long) >= 5 and all(0 < r["live_tokens"] < BUDGET + INTERVAL for r in long)
            assert 0 < s["kv_tokens_max"] < BUDGET + INTERVAL
            check_history_turns(reqs, s)


def check_history_turns(reqs, s):
    """An evicting server without a host tier: every request carries its report, a turn counts
    as continued from a device history exactly when it continued one (`history_tokens`), none
    from host, and every other later turn continued the radix prefix or was prefilled again."""
    assert all(r["history_source"] in ("device", "none") for r in reqs)
    assert all((r["history_source"] == "device") == (r["history_tokens"] > 0) for r in reqs)
    later = [r for r in reqs if r["turn"] > 1]
    # later turns only, as the summary counts them: a first turn may continue a history that an
    # earlier test on the same server left for the same opening (seen once in a fresh clone)
    device = [r for r in later if r["history_tokens"] > 0]
    assert s["turns_from_host"] == 0 and s["history_restored_tokens"] == 0
    assert s["turns_from_device"] == len(device) >= 1  # a session's turn 2 continues turn 1's
    rest = s["turns_from_prefix"] + s["turns_prefilled_again"]
    assert rest == len([r for r in later if r["history_tokens"] == 0])
    assert s["host_bytes_per_turn"] is None  # no server counters were passed


def number(reply: str) -> str | None:
    """The first run of digits in `reply`, written apart from the benchmark's own parsing."""
    digits = ""
    for ch in reply:
        if ch.isdecimal():  # what the regex \d matches
            digits += ch
        elif digits:
            break
    return digits or None


def right(reply: str, fact: str) -> bool:
    return number(reply) == fact


def check_scoring(convs):
    """`answer_record` scores a reply right exactly when its first number is the fact's, and
    `summarize` turns known right and wrong answers into accuracy and agreement."""
    for c in convs:
        wrong = str(int(c.answer) + 1)
        cases = {
            f"The number is {c.answer}.": True,
            c.answer: True,
            f"{c.answer}0": False,  # a longer number
            f"It is {c.answer[:3]}.": False,  # a partial number
            f"It is {wrong}.": False,
            f"Not {wrong}, it is {c.answer}.": False,  # the first number written counts
            "I do not know.": False,
            "": False,
        }
        for reply, hit in cases.items():
            rec = joint.answer_record(c, reply, failed=False, kv_tokens=7)
            assert rec["hit"] is hit and rec["expected"] == c.answer, (c.id, reply)
            assert rec["number"] == number(reply) and rec["kv_tokens"] == 7
        # a conversation whose turn failed is wrong whatever its reply says
        assert not joint.answer_record(c, c.answer, failed=True, kv_tokens=0)["hit"]
    # sessions 0 and 2 and document question 0 right: 3 of 5, 2 of 3 sessions, 1 of 2 documents
    replies = [f"It is {c.answer}." if i in (0, 2, 3) else "It is 7." for i, c in enumerate(convs)]
    answers = [
        joint.answer_record(c, r, False, 10 * i) for i, (c, r) in enumerate(zip(convs, replies))
    ]
    reqs = [dict(error=None, completion_tokens=1, ttft=0.1, prompt_tokens=5, cached_tokens=0)]
    # a reference that gave the same first number in conversations 0, 1 and 4 only
    reference = [
        joint.answer_record(c, r, False, 0)
        for c, r in zip(convs, [replies[0], "7", "no", "8 ", "It is 7"])
    ]
    s = joint.summarize(reqs, answers, 1.0, None, reference)
    assert (s["accuracy"], s["accuracy_session"], s["accuracy_docqa"]) == (0.6, 0.6667, 0.5)
    assert s["agreement"] == 0.6 and (s["kv_tokens_mean"], s["kv_tokens_max"]) == (20.0, 40)
