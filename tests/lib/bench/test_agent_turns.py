"""Turn by turn on an agent run's lines: which replies in the history state the key (whole), an
answer that copies the reply just before the question, the fed replies standing in for the
server's own, and the first turn that parts from a reference."""

from sgl_vtoken_tools.bench.agent_turns import cells, sessions


def req(conv: str, turn: int, reply: str, cell: str = "c") -> dict:
    return {"kind": "request", "cell": cell, "repeat": 0, "conversation": conv, "turn": turn,
            "reply": reply}  # fmt: skip


def ans(conv: str, key: str, hit: bool, cell: str = "c") -> dict:
    return {"kind": "answer", "cell": cell, "repeat": 0, "conversation": conv, "expected": key,
            "hit": hit, "fact_turn": 1}  # fmt: skip


LINES = [
    # s0: every reply repeats the key, the answer copies the one before the question
    req("s0", 1, "The key is 54288."),
    req("s0", 2, "Still 54288."),
    req("s0", 3, "54288"),
    ans("s0", "54288", True),
    # s1: the key once, early; longer and shorter numbers are not the key
    req("s1", 1, "Noted: 12345."),
    req("s1", 2, "Saw 123456 and 2345."),
    req("s1", 3, "12345"),
    ans("s1", "12345", True),
]


def test_key_turns_and_copies():
    s0, s1 = sessions(LINES)
    assert (s0["key_turns"], s0["copy"], s0["turns"]) == ([1, 2], True, 3)
    assert (s1["key_turns"], s1["copy"]) == ([1], False)  # recalled from turn 1, not copied
    assert s0["first_difference"] is None  # no reference
    (c,) = cells([s0, s1])
    assert (c["sessions"], c["hits"], c["hits_copying_the_reply_before"]) == (2, 2, 1)
    assert c["key_in_every_reply"] == 1


def test_fed_replies_are_the_history():
    """A run played with another run's replies: the history held those, not the server's."""
    fed = {("s1", 1): "Noted.", ("s1", 2): "It is 12345."}
    _, s1 = sessions(LINES, fed=fed)
    assert (s1["key_turns"], s1["copy"]) == ([2], True)


def test_first_difference_from_a_reference():
    ref = {("s0", 1): "The key is 54288.", ("s0", 2): "Another reply.", ("s0", 3): "54288"}
    s0, s1 = sessions(LINES, reference=ref)
    assert s0["first_difference"] == 2
    assert s1["first_difference"] == 1  # the reference lacks the session: every turn differs
