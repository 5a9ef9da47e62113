"""Chats in rounds: pass-key conversations (`chat_conversations.py`) played through the OpenAI
chat API the way chat clients send them (the whole conversation re-sent as text every turn, the
server's own reply fed back), all conversations turn by turn together, or one at a time
(`python -m sgl_vtoken_tools chat`).

    play(base_url, model, convs)        every conversation sends turn k at once (one thread each),
                                        waits until all answered, then turn k + 1; or
                                        `one_at_a_time`; request records and round wall seconds
    score(convs, reqs)                  answer records (the first 5-digit number of the last reply
                                        is the key) and leaks (a reply holding another
                                        conversation's key) marked on the request records
    send_turn(...)                      one streamed turn of a conversation (`new_state`): its
                                        request record, the reply appended to its history
    cell_line(...)                      one (cell, repeat)'s figures; `table(cells)` the markdown
"""

from __future__ import annotations

import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from sgl_vtoken_tools.bench.chat_conversations import Conversation
from sgl_vtoken_tools.bench.joint import Send, history_fields, history_turns
from sgl_vtoken_tools.bench.quantiles import median_text
from sgl_vtoken_tools.bench.server_log import (
    mean_running_from_log,
    peak_running_from_log,
    retracted_requests,
)

KEY_RE = re.compile(r"(?<!\d)\d{5}(?!\d)")


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
