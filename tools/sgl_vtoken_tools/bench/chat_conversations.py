"""The pass-key conversations of the chat benchmarks (`python -m sgl_vtoken_tools chat`, the
chats of `ladder`), seeded, and what one costs in KV:

    conversations(split, num, key_at)   a pass key stated in turn 1 (`first`) or mid-passage in
                                        turn 2 (`passage`), essay passages of 160-180 words to
                                        summarise, the question last
    peak_tokens(tok, messages, n)       the most KV a conversation holds (replies of n tokens)

Splits: `tuning`, `heldout` and `final` read disjoint essays (the even- and odd-indexed haystack
essays, as `quality.splits` does, and the essays the harness keeps for language modelling, which
no answer task reads) and disjoint seed ranges (`SEED_BASE`). Phrasings are this module's own
(none is a sentence of `quality.chats` or `quality.splits`), one variant per slot and turn
picked by the conversation's seed. Conversation i of (split, seed, key_at, passages) is the same
whatever `num` is. Played and scored by `chat_rounds.py`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from sgl_vtoken_tools.quality import data
from sgl_vtoken_tools.quality.splits import SPLITS
from sgl_vtoken_tools.quality.tasks import _sentences

KEY_AT = ("first", "passage")
PASSAGE_WORDS = (160, 180)
# Seeds of a split: SEED_BASE[split] + --seed, --seed below SEEDS_PER_SPLIT: no two splits share one.
SEEDS_PER_SPLIT = 1_000_000
SEED_BASE = {split: i * SEEDS_PER_SPLIT for i, split in enumerate(SPLITS)}
STATEMENTS = (
    "Remember this pass key: {key}. I will ask you for it later.",
    "Here is a pass key for you to keep in mind: {key}.",
    "Please memorize my pass key, {key}, because I will need it at the end.",
    "Note down this pass key: {key}. You will be asked about it.",
    "Keep this pass key safe for me: {key}.",
)
SUMMARIZE = (
    "Please summarize the following passage in a few sentences:\n\n{text}",
    "Give me a short summary of this text:\n\n{text}",
    "Can you write a brief summary of the passage below?\n\n{text}",
    "Read this excerpt and sum up its main points:\n\n{text}",
    "What is the gist of this passage? Summarize it briefly.\n\n{text}",
)
QUESTIONS = (
    "What was the pass key I gave you earlier? Reply with the five digits only.",
    "Please tell me the pass key from earlier in our conversation.",
    "Earlier I shared a pass key with you. What is it?",
    "Which pass key did I ask you to remember? Give just the number.",
    "Time for the pass key: please write it out as digits.",
)


@dataclass(frozen=True)
class Conversation:
    """User turns (`messages`, the question last), the `key` they state once (in turn
    `key_turn`) and how it was built (`meta`: split, seed, index, the variants picked, passages)."""

    id: str
    key: str
    key_at: str
    key_turn: int
    messages: tuple[str, ...]
    meta: dict = field(default_factory=dict, compare=False)


def split_essays(split: str, wheel_dir=None) -> list[str]:
    """The split's essays: the even-indexed (tuning) or odd-indexed (heldout) haystack essays,
    or the held-out language-modelling essays (final)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: choose from {list(SPLITS)}")
    essays = data.essays(wheel_dir)
    if split == "final":
        return [t for _, t in essays[data.HAYSTACK_ESSAYS :]]
    parity = SPLITS.index(split)
    return [t for i, (_, t) in enumerate(essays[: data.HAYSTACK_ESSAYS]) if i % 2 == parity]


def passages(
    split: str, wheel_dir=None, words: tuple[int, int] = PASSAGE_WORDS
) -> list[tuple[str, ...]]:
    """The split's passages in order: runs of consecutive sentences of one essay of `words`
    (least, most) words (whitespace collapsed), none overlapping another and none holding a
    number of 5 digits or more (only the key may look like one)."""
    lo, hi = words
    out = []
    for text in split_essays(split, wheel_dir):
        sents = [" ".join(s.split()) for s in _sentences(text)]
        start = 0
        while start < len(sents):
            words, end = 0, start
            while end < len(sents) and words < lo:
                words += len(sents[end].split())
                end += 1
            if lo <= words <= hi and not re.search(r"\d{5}", " ".join(sents[start:end])):
                out.append(tuple(sents[start:end]))
                start = end
            else:
                start += 1
    return out


def conversations(
    split: str,
    num: int,
    key_at: str = "first",
    passages_per_conv: int = 3,
    seed: int = 0,
    wheel_dir=None,
    words: tuple[int, int] = PASSAGE_WORDS,
) -> list[Conversation]:
    """`num` conversations of ``passages_per_conv + 2`` user turns. `first`: turn 1 states the
    key, then `passages_per_conv` passages to summarise; `passage`: turn 1 is a passage too and
    turn 2's passage carries the statement between its middle sentences. The question is last.
    Passages have `words` (least, most) words. No two conversations share a passage or a key.

    Raises:
        ValueError: a bad split, key_at, count or seed, or more passages than the split has."""
    if key_at not in KEY_AT:
        raise ValueError(f"key_at {key_at!r}: choose from {list(KEY_AT)}")
    if num < 1 or passages_per_conv < 1:
        raise ValueError(f"num and passages_per_conv must be >= 1 (got {num}, {passages_per_conv})")
    if not 0 <= seed < SEEDS_PER_SPLIT:
        raise ValueError(f"seed must be in [0, {SEEDS_PER_SPLIT}) (got {seed})")
    pool = passages(split, wheel_dir, words)
    per = passages_per_conv + (key_at == "passage")
    if num * per > len(pool):
        raise ValueError(
            f"{num} conversations need {num * per} passages; the {split} split has {len(pool)}"
        )
    base = SEED_BASE[split] + seed
    order = list(range(len(pool)))
    random.Random(f"bench-chat/{base}/passages").shuffle(order)
    out, keys = [], set()
    for i in range(num):
        rng = random.Random(f"bench-chat/{base}/{i}")
        key = str(rng.randrange(10000, 100000))
        while key in keys:  # depends on earlier conversations only: the same whatever num is
            key = str(rng.randrange(10000, 100000))
        keys.add(key)
        picked = order[i * per : (i + 1) * per]
        texts = [list(pool[j]) for j in picked]
        statement = rng.randrange(len(STATEMENTS))
        fact = STATEMENTS[statement].format(key=key)
        if key_at == "passage":
            mid = len(texts[1]) // 2
            texts[1] = texts[1][:mid] + [fact] + texts[1][mid:]
        asks = [rng.randrange(len(SUMMARIZE)) for _ in texts]
        msgs = [SUMMARIZE[a].format(text=" ".join(t)) for a, t in zip(asks, texts)]
        if key_at == "first":
            msgs.insert(0, fact)
        question = rng.randrange(len(QUESTIONS))
        msgs.append(QUESTIONS[question])
        out.append(
            Conversation(
                id=f"chat-{split}-{seed}-{key_at}-{i}",
                key=key,
                key_at=key_at,
                key_turn=1 if key_at == "first" else 2,
                messages=tuple(msgs),
                meta={
                    "split": split,
                    "seed": seed,
                    "index": i,
                    "statement": statement,
                    "summarize": asks,
                    "question": question,
                    "passages": picked,
                },
            )
        )
    return out


def peak_tokens(tok, messages: list[dict], max_tokens: int) -> int:
    """The most KV a conversation holds: its messages (system and user turns, `tok`'s chat
    template with the generation prompt) plus a reply of `max_tokens` and its end token (2) for
    every user turn: its last turn's prompt if every earlier reply took `max_tokens`, and that
    turn's reply. A pool smaller than this cannot hold the conversation."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turns = sum(m["role"] != "system" for m in messages)
    return len(tok(text, add_special_tokens=False)["input_ids"]) + turns * (max_tokens + 2)
