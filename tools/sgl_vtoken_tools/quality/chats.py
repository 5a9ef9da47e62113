"""Chat-shaped recall conversations: a pass key, three passages to summarise, then the question.

The conversations a chat client holds, as opposed to the split sessions (`splits.py`, fact alone
or at a depth, replies of a few tokens): every reply is the model's own, as long as it writes
it (up to the caller's cap), and feeds the next turn. Two groups:

    first   turn 1 states the key in a message of its own; turns 2-4 are passages to summarise
    mid     turn 1 is a passage, turn 2 a passage with the key stated mid-passage (between its
            middle sentences); turns 3-4 passages
    both    turn 5 asks for the key (the phrasing's question): exact match of the first number
            of the reply

Passages come from the split's essays (`splits.split_sentences`) and the key and fact phrasing
from the split (`splits.PHRASINGS`), so the tuning split chooses and the held-out split only
measures. Trial i of (split, group, seed) is the same conversation whatever `num` is.
"""

from __future__ import annotations

import random

from sgl_vtoken_tools.quality.splits import PHRASINGS, _check, split_sentences
from sgl_vtoken_tools.quality.tasks import Trial, _excerpt, chat_ids

GROUPS = ("first", "mid")
FIRST = "{fact}"
SUMMARISE = "Summarize this passage:\n\n{text}"


def chat_trials(
    tokenizer,
    split: str,
    group: str,
    num: int,
    passage_tokens: int = 150,
    seed: int = 0,
    wheel_dir=None,
) -> list[Trial]:
    """`num` conversations of `group` (``first`` or ``mid``) from `split`; trial i uses phrasing
    ``i % len(PHRASINGS[split])``. ``prompt`` is turn 1's chat ids, ``messages`` the user turns
    after it (the question last); ``span`` is the fact's tokens in turn 1 (``(0, 0)`` for mid)."""
    _check(split)
    if group not in GROUPS:
        raise ValueError(f"group {group!r}: choose from {list(GROUPS)}")
    sents = split_sentences(split, wheel_dir)
    phrasings = PHRASINGS[split]
    out = []
    for i in range(num):
        rng = random.Random(f"{split}/chat/{group}/{seed}/{i}")
        ph = phrasings[i % len(phrasings)]
        key = str(rng.randrange(10000, 100000))
        fact = ph.fact.format(key=key)
        count = 3 if group == "first" else 4
        passages = [_excerpt(tokenizer, sents, rng, passage_tokens) for _ in range(count)]
        if group == "first":
            first = FIRST.format(fact=fact)
        else:
            hay = passages[1]
            at = len(hay) // 2
            passages[1] = hay[:at] + [fact + " "] + hay[at:]
            first = SUMMARISE.format(text="".join(passages.pop(0)).rstrip())
        messages = tuple(SUMMARISE.format(text="".join(p).rstrip()) for p in passages)
        ids, offsets, text = chat_ids(tokenizer, first)
        span = (0, 0)
        if group == "first":
            lo = text.index(fact)
            idx = [j for j, (a, b) in enumerate(offsets) if a < lo + len(fact) and b > lo]
            span = (idx[0], idx[-1] + 1)
        out.append(
            Trial(
                "chat",
                f"chat-{split}-{group}-{seed}-{i}",
                tuple(ids),
                key,
                {"split": split, "group": group, "seed": seed, "phrasing": ph.name},
                span=span,
                messages=messages + (ph.question,),
                user=first,
            )
        )
    return out
