"""Dense retrieval tasks in the three splits (`splits.py`): whole 7-digit values asked back.

    kv       many lines ``key: value`` (a key of two or three words, a 7-digit value), about
             `length` tokens of them; one key, at `depth` of the list, is asked for
    needle   one line stating a 7-digit value for a two-word key, at `depth` of a filler text
             repeated to about `length` tokens

The answer is exact only when the reply's first number is the whole value: a prefix (``901`` for
``9011417``) is a miss, recorded as ``prefix`` (:func:`value_outcome`). The splits share no
words, filler, phrasing or seed::

              key words     kv phrasing               needle filler / phrasing        depths
    tuning    TUNING_WORDS  "key: value" list         RULER's noise, magic number     0.1 ... 0.85
    heldout   HELDOUT_WORDS "key: value" table        rivers and hills, secret code   0.2 ... 0.95
    final     FINAL_WORDS   "key = value" inventory   trains and bread, entry code    0.15 ... 0.9
"""

from __future__ import annotations

import random

from sgl_vtoken_tools.quality.splits import DEPTHS, _check
from sgl_vtoken_tools.quality.tasks import Trial, _span, chat_ids, first_number

TUNING_WORDS = (
    "amber apple arrow autumn basket bell birch bridge candle canyon cedar chalk cherry cloud "
    "copper coral crystal desert ember falcon feather forest garden glacier harbor hazel island "
    "ivory jasper lantern lemon maple marble meadow mirror orchid pebble pepper"
).split()
HELDOUT_WORDS = (
    "anchor badger beacon blossom bramble cactus cinder clover comet cotton daisy dolphin "
    "engine fabric ginger granite hollow honey indigo jungle kettle ladder linen lotus magnet "
    "nectar oyster paddle parrot quartz raven ribbon saddle spruce thistle tulip velvet walnut"
).split()
FINAL_WORDS = (
    "acorn albatross bison bluebell buckle canoe cashew cobalt cricket cypress drum elm fern "
    "fjord gazelle gravel heron iris juniper kayak kiwi lagoon lilac mango meteor mint nickel "
    "olive opal panther plum puffin quill reef saffron sparrow tiger topaz willow yarrow"
).split()
WORDS = {"tuning": TUNING_WORDS, "heldout": HELDOUT_WORDS, "final": FINAL_WORDS}

KV = {
    "tuning": (
        "Below is a list of keys and their values. Memorize them.\n\n",
        "{key}: {value}\n",
        "What is the value of {key}? Answer with the number only.",
    ),
    "heldout": (
        "Here is a table of entries, one per line: a name, then its number.\n\n",
        "{key}: {value}\n",
        "Which number is listed for {key}? Answer with the number only.",
    ),
    "final": (
        "The inventory below lists every item with its serial number.\n\n",
        "{key} = {value}\n",
        "What is the serial number of {key}? Answer with the number only.",
    ),
}
NEEDLE = {
    "tuning": (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
        "again. ",
        "One of the special magic numbers for {key} is: {value}. ",
        "What is the special magic number for {key} mentioned in the provided text? "
        "Answer with the number only.",
    ),
    "heldout": (
        "The river runs to the sea. The hills are quiet. The wind is cold tonight. We walk "
        "on. Far and near again. ",
        "The secret code for {key} is {value}. ",
        "What is the secret code for {key}? Answer with the number only.",
    ),
    "final": (
        "The train leaves at noon. Bread is baked at dawn. The lamps are lit at dusk. Days go "
        "by. Round and round again. ",
        "The entry code for {key} is {value}. ",
        "What is the entry code for {key}? Answer with the number only.",
    ),
}


def value_outcome(text: str, answer: str) -> str:
    """``exact`` (the first number is the value), ``prefix`` (a strict prefix of it), ``other``
    (another number) or ``none`` (no number)."""
    got = first_number(text)
    if got is None:
        return "none"
    if got == answer:
        return "exact"
    return "prefix" if answer.startswith(got) else "other"


def _key(rng: random.Random, words: tuple[str, ...] | list[str], taken: set[str]) -> str:
    while True:
        key = " ".join(rng.sample(words, rng.choice((2, 3))))
        if key not in taken:
            taken.add(key)
            return key


def _value(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _trial(tokenizer, task, split, seed, length, depth, k, intro, body, fact, question):
    """The chat prompt ``intro + body + question`` as a Trial; `fact` is the asked-for line
    inside `body` (its tokens are the trial's span)."""
    user = intro + body.rstrip() + "\n\n" + question
    ids, offsets, text = chat_ids(tokenizer, user)
    lo = text.index(user) + len(intro) + body.index(fact)
    q = text.rindex(question)
    return Trial(
        task,
        f"{task}-{split}-{seed}-{length}-{depth:g}-{k}",
        tuple(ids),
        "",  # filled by the caller
        {
            "split": split,
            "seed": seed,
            "length": length,
            "depth": depth,
            "prompt_tokens": len(ids),
            "question_at": _span(offsets, q, q + len(question))[0],
        },
        span=_span(offsets, lo, lo + len(fact.rstrip())),
        user=user,
    )


def kv_trials(
    tokenizer, split: str, lengths: list[int], per_length: int = 20, seed: int = 0
) -> list[Trial]:
    """`per_length` trials per length, spread over the split's depths: key-value lines of
    about `length` tokens, one key asked for."""
    _check(split)
    intro, line, ask = KV[split]
    out = []
    for length in lengths:
        for k in range(per_length):
            depth = DEPTHS[split][k % len(DEPTHS[split])]
            rng = random.Random(f"{split}/kv/{seed}/{length}/{k}")
            taken: set[str] = set()
            pairs: list[tuple[str, str]] = []
            per_line = _count(tokenizer, line.format(key="a b c", value="1234567"))
            while per_line * len(pairs) < length:
                pairs.append((_key(rng, WORDS[split], taken), _value(rng)))
            lines = [line.format(key=k, value=v) for k, v in pairs]
            at = min(len(lines) - 1, round(depth * len(lines)))
            fact, (key, value) = lines[at], pairs[at]
            body = "".join(lines)
            t = _trial(
                tokenizer,
                "kv",
                split,
                seed,
                length,
                depth,
                k,
                intro,
                body,
                fact,
                ask.format(key=key),
            )
            out.append(_answer(t, value, lines=len(lines)))
    return out


def needle_trials(
    tokenizer, split: str, lengths: list[int], per_length: int = 20, seed: int = 0
) -> list[Trial]:
    """`per_length` trials per length over the split's depths: one value line at `depth` of the
    split's filler repeated to about `length` tokens."""
    _check(split)
    filler, needle, ask = NEEDLE[split]
    out = []
    for length in lengths:
        reps = max(1, round(length / _count(tokenizer, filler)))
        for k in range(per_length):
            depth = DEPTHS[split][k % len(DEPTHS[split])]
            rng = random.Random(f"{split}/needle/{seed}/{length}/{k}")
            key, value = _key(rng, WORDS[split], set()), _value(rng)
            at = round(depth * reps)
            fact = needle.format(key=key, value=value)
            body = filler * at + fact + filler * (reps - at)
            t = _trial(
                tokenizer,
                "needle",
                split,
                seed,
                length,
                depth,
                k,
                "",
                body,
                fact,
                ask.format(key=key),
            )
            out.append(_answer(t, value))
    return out


def _answer(t: Trial, value: str, **meta) -> Trial:
    return Trial(t.task, t.id, t.prompt, value, {**t.meta, **meta}, t.span, (), t.user)
