"""The long chat states and asks for a key each turn, grows its prompt turn by turn from the
model's own replies, stops at a refused turn, and counts whole keys per band of turns."""

from sgl_vtoken_tools.quality import long_chat, splits


def test_each_turn_states_the_key_it_asks_for_in_the_split_phrasing(tiny_tok, wheel_dir):
    convs = long_chat.conversations("heldout", 2, 12, 40, tiny_tok, wheel_dir=wheel_dir)
    again = long_chat.conversations("heldout", 1, 12, 40, tiny_tok, wheel_dir=wheel_dir)
    assert again[0] == convs[0] and len(convs) == 2 and all(len(c) == 12 for c in convs)
    questions = {p.question for p in splits.PHRASINGS["heldout"]}
    for message, key in convs[0] + convs[1]:
        assert key in message and len(key) == 5
        assert message.rsplit("\n\n", 1)[1] in questions
    tuning = long_chat.conversations("tuning", 1, 12, 40, tiny_tok, wheel_dir=wheel_dir)
    assert {m for m, _ in tuning[0]}.isdisjoint(m for m, _ in convs[0])


class Replies:
    """A server that answers each turn's key, refusing prompts longer than `limit`."""

    def __init__(self, tok, keys, limit):
        self.tok, self.keys, self.limit, self.prompts = tok, keys, limit, []

    def generate(self, ids, rid, max_new, kv_evict, stop=None):
        if len(ids) > self.limit:
            raise RuntimeError("/generate -> HTTP 400: too long")
        self.prompts.append(list(ids))
        k = int(rid.rsplit("-t", 1)[1])
        out = self.tok(f"It is {self.keys[k]}.", add_special_tokens=False)["input_ids"]
        return {"output_ids": out + [stop], "meta_info": {"cached_tokens": 0}}


def test_a_conversation_grows_from_its_replies_and_ends_at_a_refused_turn(tiny_tok, wheel_dir):
    conv = long_chat.conversations("heldout", 1, 12, 40, tiny_tok, wheel_dir=wheel_dir)[0]
    keys = [k for _, k in conv]
    server = Replies(tiny_tok, keys, limit=10**6)
    rec = long_chat.play(server, tiny_tok, conv, "full", "c0", 16)
    assert rec["answered"] == rec["hits"] == 12
    for before, after in zip(server.prompts, server.prompts[1:]):
        assert after[: len(before)] == before  # each turn extends the last prompt and its reply
    limit = len(server.prompts[4])
    short = long_chat.play(Replies(tiny_tok, keys, limit), tiny_tok, conv, "stock", "c0", 16)
    assert short["answered"] == 5 and "refused" in short["turns"][-1]
    lines = long_chat.summary([rec, short], 12)
    assert [(x["server"], x["turns"], x["asked"], x["answered"], x["hits"]) for x in lines] == [
        ("full", "1-10", 10, 10, 10),
        ("full", "11-20", 2, 2, 2),
        ("stock", "1-10", 10, 5, 5),
        ("stock", "11-20", 2, 0, 0),
    ]
