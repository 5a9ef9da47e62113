"""Quality tasks as token ids, generated deterministically from a seed and a tokenizer.

    passkey  a 5-digit pass key stated twice in one sentence, hidden at a given depth of a
             haystack of essays (chat template); the answer ("The pass key is 12345.") writes
             every digit after the first eviction: exact match of the first number
    recall   a fact (a 4-digit pass key) in turn 1, filler turns (an essay passage to
             summarise), the question at the last turn; each turn continues from the previous
             turn's tokens: exact match of the first number (SmolLM2-135M-Instruct answers
             this framing at full cache; "remember my room number / locker code" it does not)
    lm       windows of held-out essays: `context` tokens, then `continuation` tokens
             teacher-forced under eviction (perplexity, top-1 agreement) and a greedy
             continuation compared with the full cache's

A task never depends on the model's outputs except through the turns of a conversation, which
the runner builds with :func:`next_turn_ids`.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

from sgl_vtoken_tools.quality import data

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it.\n\n"
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? Answer with the number only."
RECALL_FACT = "The pass key is {key}. Remember it. {key} is the pass key."
RECALL_FILLER = (
    "Here is a passage:\n\n{text}\n\nWhat is this passage about? Answer in one sentence."
)
RECALL_QUESTION = "What is the pass key? Answer with the number only."


@dataclass(frozen=True)
class Trial:
    """One prompt with its expected answer. `span` = ``[start, end)`` token range of the needle
    (passkey) or of the fact's message (recall); `messages` = later user turns (recall);
    `user` = the first user message as text, where a chat client needs it (the split tasks)."""

    task: str
    id: str
    prompt: tuple[int, ...]
    answer: str
    meta: dict = field(default_factory=dict)
    span: tuple[int, int] = (0, 0)
    messages: tuple[str, ...] = ()
    user: str = field(default="", compare=False)


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def exact_number(text: str, answer: str) -> bool:
    """The first number written in `text` is `answer` (a partial "677" for "67712" is a miss)."""
    return first_number(text) == answer


def trial_record(label: str, trial: Trial, answer: str, turns: list, t0: float, **more) -> dict:
    """The `trial` line of a multi-turn trial played under setting `label`: `hit` when the
    first number of `answer` is the whole expected one; `more` goes before the trial's meta;
    `seconds` since `t0` (monotonic)."""
    return {
        "kind": "trial",
        "setting": label,
        **more,
        "trial": trial.id,
        **trial.meta,
        "hit": exact_number(answer, trial.answer),
        "expected": trial.answer,
        "answer": answer,
        "turns": turns,
        "seconds": round(time.monotonic() - t0, 1),
    }


def chat_ids(tokenizer, user: str) -> tuple[list[int], list[tuple[int, int]], str]:
    """Chat-template ids of one user message with the generation prompt, their character
    offsets and the rendered text."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), list(enc["offset_mapping"]), text


def next_turn_ids(tokenizer, message: str, previous_output: list[int]) -> list[int]:
    """Tokens that follow a reply to start the next user turn (closing the reply if it was cut
    at its token limit), ending with the assistant generation prompt."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    close = [] if previous_output and previous_output[-1] == eos else [eos]
    text = f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    return close + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sentences(text: str) -> list[str]:
    return [s.strip() + " " for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def _span(offsets, lo: int, hi: int) -> tuple[int, int]:
    idx = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    return (idx[0], idx[-1] + 1) if idx else (0, 0)


def _excerpt(tokenizer, sents: list[str], rng: random.Random, tokens: int) -> list[str]:
    """Consecutive sentences from a random start, about `tokens` tokens in all."""
    start = rng.randrange(0, len(sents) - 1)
    out, n = [], 0
    for s in sents[start:] + sents[:start]:
        if n >= tokens:
            break
        out.append(s)
        n += len(tokenizer(s, add_special_tokens=False)["input_ids"])
    return out


def passkey_trials(
    tokenizer, lengths: list[int], depths: list[float], seed: int = 0, wheel_dir=None
) -> list[Trial]:
    """One trial per (haystack length in tokens, needle depth in [0, 1])."""
    sents = _sentences(data.haystack_text(wheel_dir))
    out = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(f"passkey/{seed}/{length}/{depth}")
            key = str(rng.randrange(10000, 100000))
            hay = _excerpt(tokenizer, sents, rng, length)
            at = round(depth * len(hay))
            needle = PASSKEY_NEEDLE.format(key=key)
            before = "".join(hay[:at])
            user = PASSKEY_INTRO + before + needle + "".join(hay[at:]).rstrip() + PASSKEY_QUESTION
            ids, offsets, text = chat_ids(tokenizer, user)
            lo = text.index(PASSKEY_INTRO) + len(PASSKEY_INTRO) + len(before)
            out.append(
                Trial(
                    "passkey",
                    f"passkey-{length}-{depth:g}",
                    tuple(ids),
                    key,
                    {"length": length, "depth": depth, "prompt_tokens": len(ids)},
                    span=_span(offsets, lo, lo + len(needle.rstrip())),
                )
            )
    return out


def recall_trials(
    tokenizer, num: int, fillers: int = 2, filler_tokens: int = 200, seed: int = 0, wheel_dir=None
) -> list[Trial]:
    """Conversations: the fact, `fillers` passages to summarise, then the question (turn
    ``fillers + 2``)."""
    sents = _sentences(data.haystack_text(wheel_dir))
    out = []
    for i in range(num):
        rng = random.Random(f"recall/{seed}/{i}")
        key = str(rng.randrange(1000, 10000))
        fact = RECALL_FACT.format(key=key)
        ids, offsets, text = chat_ids(tokenizer, fact)
        lo = text.index(fact)
        passages = [
            "".join(_excerpt(tokenizer, sents, rng, filler_tokens)).rstrip() for _ in range(fillers)
        ]
        messages = tuple(RECALL_FILLER.format(text=p) for p in passages) + (RECALL_QUESTION,)
        out.append(
            Trial(
                "recall",
                f"recall-{i}",
                tuple(ids),
                key,
                {"turns": fillers + 2, "fillers": fillers},
                span=_span(offsets, lo, lo + len(fact)),
                messages=messages,
            )
        )
    return out


def lm_trials(
    tokenizer, num: int, context: int, continuation: int, seed: int = 0, wheel_dir=None
) -> list[Trial]:
    """`num` windows of ``context + continuation`` tokens of held-out essays, non-overlapping,
    at seeded offsets; `answer` is unused (the continuation is in ``meta``)."""
    ids = list(
        tokenizer("\n\n".join(data.heldout_texts(wheel_dir)), add_special_tokens=False)["input_ids"]
    )
    size = context + continuation
    slots = len(ids) // size
    if slots < num:
        raise ValueError(
            f"held-out text has {len(ids)} tokens: room for {slots} windows of "
            f"{size} (asked {num}); lower --lm-windows or the window size"
        )
    rng = random.Random(f"lm/{seed}")
    out = []
    for k, slot in enumerate(sorted(rng.sample(range(slots), num))):
        w = ids[slot * size : (slot + 1) * size]
        out.append(
            Trial(
                "lm",
                f"lm-{k}",
                tuple(w[:context]),
                "",
                {"continuation": w[context:], "offset": slot * size},
            )
        )
    return out
