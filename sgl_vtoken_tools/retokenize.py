"""How often a chat client's next turn reproduces the token ids the server stored for a history.

Through the chat API the server keeps a turn's ids (template + prompt + generated reply), while
the client re-sends the reply as text: the next turn's prompt is the chat template applied to the
messages, the reply decoded (special tokens skipped, as the OpenAI server returns it). Where that
re-tokenizes differently, a stored compacted history is reused only up to the first differing id
(docs/design.md, "Compacted histories"). :func:`probe` measures it with a model's own greedy
replies (no server: the ids are the ones a greedy server would store).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch


@dataclass
class TurnProbe:
    """One conversation's second turn against its first."""

    history: int  # ids the server holds for turn 1 (prompt + reply, end of turn excluded)
    common: int  # ids of turn 2's prompt equal to them, from the start
    exact: bool  # turn 2's prompt starts with the whole history

    def as_dict(self) -> dict:
        return asdict(self)


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@torch.no_grad()
def probe_one(
    model, tokenizer, system: str, user: str, follow_up: str, max_new_tokens: int
) -> TurnProbe:
    """Turn 1 greedily (`model`), then turn 2's prompt as a chat client would build it."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    prompt = _ids(tokenizer, messages, True)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    reply = out[0, len(prompt) :].tolist()
    eos = tokenizer.eos_token_id
    if eos in reply:  # the server stops there; the end-of-turn id is the template's again
        reply = reply[: reply.index(eos)]
    history = prompt + reply
    text = tokenizer.decode(reply, skip_special_tokens=True)
    turn2 = _ids(
        tokenizer,
        messages + [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}],
        True,
    )
    common = _common(history, turn2)
    return TurnProbe(history=len(history), common=common, exact=common == len(history))


def probe(
    model, tokenizer, words: list[str], conversations: int, max_new_tokens: int, seed: int = 0
) -> list[TurnProbe]:
    """`conversations` two-turn chats with messages drawn from `words`."""
    rng = random.Random(seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."

    return [
        probe_one(
            model,
            tokenizer,
            sentence(12),
            sentence(rng.randrange(6, 20)),
            sentence(8),
            max_new_tokens,
        )
        for _ in range(conversations)
    ]


def summary(results: list[TurnProbe]) -> dict:
    """Share of turns whose prompt reproduces the whole history, and of history ids reused."""
    n = len(results)
    return {
        "conversations": n,
        "exact_share": sum(r.exact for r in results) / n,
        "history_ids": sum(r.history for r in results),
        "reused_share": sum(r.common for r in results) / max(1, sum(r.history for r in results)),
    }
