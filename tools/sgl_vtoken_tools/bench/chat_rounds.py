"""Chats in rounds: pass-key conversations played through the OpenAI chat API the way chat
clients send them (the whole conversation re-sent as text every turn, the server's own reply fed
back), all conversations turn by turn together, or one at a time (`python -m sgl_vtoken_tools chat`).

    conversations(split, num, key_at)   seeded conversations: a pass key stated in turn 1 (`first`)
                                        or mid-passage in turn 2 (`passage`), essay passages of
                                        160-180 words to summarise, the question last
    play(base_url, model, convs)        every conversation sends turn k at once (one thread each),
                                        waits until all answered, then turn k + 1; or
                                        `one_at_a_time`; request records and round wall seconds
    score(convs, reqs)                  answer records (the first 5-digit number of the last reply
                                        is the key) and leaks (a reply holding another
                                        conversation's key) marked on the request records
    send_turn(...)                      one streamed turn of a conversation (`new_state`): its
                                        request record, the reply appended to its history
    peak_tokens(tok, messages, n)       the most KV a conversation holds (replies of n tokens)
    cell_line(...)                      one (cell, repeat)'s figures; `table(cells)` the markdown

Splits: `tuning`, `heldout` and `final` read disjoint essays (the even- and odd-indexed haystack
essays, as `quality.splits` does, and the essays the harness keeps for language modelling, which
no answer task reads) and disjoint seed ranges (`SEED_BASE`). Phrasings are this module's own
(none is a sentence of `quality.chats` or `quality.splits`), one variant per slot and turn
picked by the conversation's seed. Conversation i of (split, seed, key_at, passages) is the same
whatever `num` is.
"""

from __future__ import annotations

import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from sgl_vtoken_tools.bench.joint import Send, history_fields, history_turns
from sgl_vtoken_tools.bench.quantiles import median_text
from sgl_vtoken_tools.bench.server_log import (
    mean_running_from_log,
    peak_running_from_log,
    retracted_requests,
)
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
KEY_RE = re.compile(r"(?<!\d)\d{5}(?!\d)")


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


def reply_key(text: str) -> str | None:
    """The first number of exactly 5 digits in `text` (None without one)."""
    m = KEY_RE.search(text)
    return m.group(0) if m else None


def foreign_keys(text: str, own: str, keys: set[str]) -> list[str]:
    """The keys of `keys` other than `own` that `text` writes as a number of 5 digits, sorted."""
    return sorted(set(KEY_RE.findall(text)) & (keys - {own}))


def score(convs: list[Conversation], reqs: list[dict]) -> list[dict]:
    """Marks every request record with `leaked` (other conversations' keys in its reply) and
    returns one answer record per conversation (its order): `hit` when no turn failed, the last
    turn was answered and its reply's first 5-digit number is the key."""
    keys = {c.key for c in convs}
    by_conv = {c.id: c for c in convs}
    for r in reqs:
        r["leaked"] = foreign_keys(r.get("reply") or "", by_conv[r["conversation"]].key, keys)
    out = []
    for c in convs:
        mine = sorted((r for r in reqs if r["conversation"] == c.id), key=lambda r: r["turn"])
        last = mine[-1] if mine else None
        failed = any(r["error"] is not None for r in mine) or len(mine) < len(c.messages)
        reply = last["reply"] if last and last["turn"] == len(c.messages) else ""
        out.append(
            {
                "kind": "answer",
                "conversation": c.id,
                "key_at": c.key_at,
                "expected": c.key,
                "reply": reply,
                "number": reply_key(reply),
                "hit": not failed and reply_key(reply) == c.key,
                "failed": failed,
                "leaks": sum(bool(r["leaked"]) for r in mine),
            }
        )
    return out


def new_state(messages: list[dict] | tuple = ()) -> dict:
    """A conversation's client state for `send_turn`: its HTTP session, the history so far
    (`messages`, e.g. a system prompt) and whether its last turn succeeded (`alive`)."""
    return {"http": requests.Session(), "messages": list(messages), "alive": True}


def send_turn(
    base_url: str,
    model: str,
    conv_id: str,
    content: str,
    state: dict,
    turn: int,
    send: Send,
    t0: float,
) -> dict:
    """Send user turn `turn` (`content`) of conversation `conv_id` as `send` says, its history in
    `state` (`new_state`), streamed; returns its request record and appends the reply to the
    history. `t0`: monotonic; the record's `t_start` and `t_end` count from it."""
    state["messages"].append({"role": "user", "content": content})
    messages = list(state["messages"])
    rec, payload = send.stream(state["http"], base_url, model, messages, conv_id, turn)
    report = rec.pop("kv_evict")
    reply = rec.pop("text")
    state["messages"].append({"role": "assistant", "content": reply})
    state["alive"] = rec["error"] is None
    return {
        "kind": "request",
        "conversation": conv_id,
        "turn": turn,
        "rid": payload["rid"],
        "prompt_tokens": rec["prompt_tokens"],
        "cached_tokens": rec["cached_tokens"],
        "completion_tokens": rec["completion_tokens"],
        "latency": round(rec["e2e"], 4),
        "ttft": None if rec["ttft"] is None else round(rec["ttft"], 4),
        "t_start": round(rec["t_start"] - t0, 4),
        "t_end": round(time.monotonic() - t0, 4),
        "finish_reason": rec["finish_reason"],
        "error": rec["error"],
        "evicted_tokens": None if report is None else report.get("evicted_tokens", 0),
        "evictions": None if report is None else report.get("evictions", 0),
        "evicted_at": None if report is None else report.get("evicted_at"),
        "live_tokens": rec["live_tokens"],
        "history_tokens": rec["history_tokens"],
        "history_view_tokens": rec["history_view_tokens"],
        **history_fields(report),
        "kv_evict": report,
        "reply": reply,
    }


def play(
    base_url: str,
    model: str,
    convs: list[Conversation],
    send: Send,
    one_at_a_time: bool = False,
) -> tuple[list[dict], float, list[float]]:
    """Play `convs` in rounds (turn k of every conversation at once, one thread each, the next
    turn once all answered) or `one_at_a_time` (each conversation alone, turn by turn), each
    turn as `send` says. A conversation stops at a failed turn. Returns the request records
    (time order, each with its `reply`), the wall seconds and the wall seconds of each round
    (one per turn; one-at-a-time: one per conversation)."""
    t0 = time.monotonic()
    states = {c.id: new_state() for c in convs}
    reqs, rounds = [], []
    if one_at_a_time:
        for c in convs:
            t = time.monotonic()
            for turn in range(1, len(c.messages) + 1):
                msg = c.messages[turn - 1]
                reqs.append(send_turn(base_url, model, c.id, msg, states[c.id], turn, send, t0))
                if not states[c.id]["alive"]:
                    break
            rounds.append(round(time.monotonic() - t, 3))
    else:
        with ThreadPoolExecutor(max_workers=len(convs)) as pool:
            for turn in range(1, max(len(c.messages) for c in convs) + 1):
                live = [c for c in convs if states[c.id]["alive"] and turn <= len(c.messages)]
                t = time.monotonic()
                reqs += pool.map(
                    lambda c, turn=turn: send_turn(
                        base_url, model, c.id, c.messages[turn - 1], states[c.id], turn, send, t0
                    ),
                    live,
                )
                rounds.append(round(time.monotonic() - t, 3))
    wall = time.monotonic() - t0
    for s in states.values():
        s["http"].close()
    return sorted(reqs, key=lambda r: r["t_start"]), wall, rounds


def cell_line(
    answers: list[dict],
    reqs: list[dict],
    wall: float,
    rounds: list[float],
    log: str | None = None,
    server_evicted: int | None = None,
) -> dict:
    """One (cell, repeat)'s figures: answers of the conversations, replies with another
    conversation's key (`leaks`), output tokens/s over the play's wall seconds, prompt tokens
    sent and computed (sent less SGLang's `cached_tokens`), evicted tokens (the requests'
    reports; None when none carried one; `server_evicted_tokens`: the server's counter over the
    play), retractions, peak running and mean running (rows a decode step carried) from the `log`
    written during the play, later turns by
    how their history came back (`joint.history_turns`), latency per request and per round."""
    ok = [r for r in reqs if r["error"] is None]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    sent = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    reported = [r["evicted_tokens"] for r in reqs if r["evicted_tokens"] is not None]
    lat = [r["latency"] for r in ok]
    return {
        "conversations": len(answers),
        "answers": sum(a["hit"] for a in answers),
        "leaks": sum(bool(r["leaked"]) for r in reqs),
        "requests": len(reqs),
        "failed": len(reqs) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 3) if wall > 0 else None,
        "prompt_tokens_sent": sent,
        "cached_tokens": cached,
        "prompt_tokens_computed": sent - cached,
        "evicted_tokens": sum(reported) if reported else None,
        "server_evicted_tokens": server_evicted,
        "evictions": sum(r["evictions"] or 0 for r in reqs) if reported else None,
        "retractions": retracted_requests(log) if log is not None else None,
        "peak_running": peak_running_from_log(log) if log is not None else None,
        "mean_running": mean_running_from_log(log) if log is not None else None,
        **history_turns(reqs),
        "mean_latency_s": round(statistics.mean(lat), 3) if lat else None,
        "round_s": rounds,
    }


def table(cells: list[dict]) -> str:
    """Markdown, one row per (cell, key_at, mode) in first-seen order: answers over all repeats
    (with the range per repeat), leaks, output tok/s, prompt tokens computed, retractions and
    mean running rows as medians over repeats with (min-max)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["cell"], c.get("key_at"), c.get("mode")), []).append(c)
    lines = [
        "| cell | key at | play | repeats | answers | leaks | output tok/s "
        "| prompt tokens computed | retractions | mean running |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (cell, key_at, mode), rows in groups.items():
        hits = [r["answers"] for r in rows]
        total = sum(r["conversations"] for r in rows)
        per = "" if min(hits) == max(hits) else f" ({min(hits)}-{max(hits)})"
        lines.append(
            f"| {cell} | {key_at} | {mode} | {len(rows)} | {sum(hits)}/{total}{per} "
            f"| {sum(r['leaks'] for r in rows)} "
            f"| {median_text([r['output_tokens_per_s'] for r in rows])} "
            f"| {median_text([r['prompt_tokens_computed'] for r in rows], 0)} "
            f"| {median_text([r['retractions'] for r in rows], 0)} "
            f"| {median_text([r.get('mean_running') for r in rows], 1)} |"
        )
    return "\n".join(lines) + "\n"
