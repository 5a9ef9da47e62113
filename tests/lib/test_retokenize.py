"""The re-tokenization probe on the tiny model's tokenizer: a reply whose ids are the canonical
encoding of its text comes back whole; a reply encoded otherwise comes back up to its first
non-canonical id."""

import torch

from sgl_vtoken_tools.retokenize import probe_one, summary


class Replier:
    """A stand-in model whose greedy reply is fixed ids."""

    def __init__(self, reply):
        self.reply = reply

    def generate(self, ids, **kwargs):
        return torch.cat([ids, torch.tensor([self.reply])], dim=1)


def test_canonical_replies_round_trip_and_others_are_reused_up_to_the_first_difference(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = " return the value"
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    r = probe_one(Replier(canonical), tok, "You are terse.", "What does it do?", "And then?", 8)
    assert r.exact and r.common == r.history
    # The same text as one id per byte-level character: decodes to the same string, encodes back
    # to the canonical (fewer) ids, so the history survives up to the reply's first id only.
    chars = [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(canonical)[0]]
    split = chars + canonical[1:]
    assert tok.decode(split) == tok.decode(canonical) and split != canonical
    r = probe_one(Replier(split), tok, "You are terse.", "What does it do?", "And then?", 8)
    assert not r.exact and r.common == r.history - len(split)
    s = summary([r, r])
    assert s["exact_share"] == 0 and 0 < s["reused_share"] < 1
