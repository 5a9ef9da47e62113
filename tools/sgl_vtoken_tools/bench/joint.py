"""Speed and answers in one run: concurrent chat conversations whose answers are known.

    conversations(tok, spec)   the split's sessions (several turns, a fact stated once, asked
                               last) and document questions (one turn), as a chat client sends
                               them: user messages, the expected number, fixed request ids
    play(base_url, ...)        every conversation in its own thread, all at once (or
                               `concurrency` at a time), each turn a streamed chat completion
                               re-sending the whole history; request and answer records
    answer_record(...)         a conversation's score: the first number of its last reply
                               against the number its fact planted
    summarize(...)             one cell's figures: output tokens/s, TTFT, prompt tokens
                               computed, later turns by how their history came back, host
                               bytes moved per turn, accuracy, agreement with the full
                               cache's answers, device KV per conversation, retractions and
                               peak running requests from the server's log
    history_fields(report)     a request's history source and restored tokens
    held_tokens(rec)           the device KV a request held at its end
    history_turns(reqs)        later turns continued from a device or a host history, from
                               SGLang's radix prefix, or prefilled again
    host_counters(state)       the host-history counters of a plugin state reading

Tasks come from `sgl_vtoken_tools.quality.splits` (tuning or held-out split), so a setting
chosen on one split is scored on the other. Request ids are ``{prefix}-{conversation}-t{turn}``
on every server, so seeded policies pick the same victims in every cell.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from sgl_vtoken_tools.bench.http_client import chat_payload, stream_chat
from sgl_vtoken_tools.bench.server_log import (
    mean_running_from_log,
    peak_running_from_log,
    retracted_requests,
)
from sgl_vtoken_tools.quality.splits import SPLITS, docqa_trials, session_trials
from sgl_vtoken_tools.quality.tasks import exact_number, first_number

# The plugin's host-history counters (`probe.vtoken_state`): a repeat reports their growth.
HOST_COUNTERS = (
    "host_histories_stored",
    "host_histories_restored",
    "host_histories_dropped",
    "host_bytes_to_host",
    "host_bytes_to_device",
)


@dataclass(frozen=True)
class JointSpec:
    """The conversations of one run: `sessions` multi-turn sessions of `turns` user turns
    (passages of `passage_tokens`), and `docqa` document questions spread evenly over the split's
    trials at `docqa_lengths`; replies of at most `reply_tokens` tokens (greedy, stop at EOS)."""

    split: str = "heldout"
    sessions: int = 12
    turns: int = 4
    passage_tokens: int = 200
    docqa: int = 12
    docqa_lengths: tuple[int, ...] = (1000, 2000)
    seed: int = 0
    reply_tokens: int = 128

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"JointSpec.split must be one of {list(SPLITS)} (got {self.split!r})")
        for name in ("sessions", "docqa"):
            if getattr(self, name) < 0:
                raise ValueError(f"JointSpec.{name} must be >= 0 (got {getattr(self, name)})")
        if self.sessions + self.docqa < 1:
            raise ValueError("JointSpec: give at least one session or document question")
        if (
            self.turns < 2
            or self.reply_tokens < 1
            or self.passage_tokens < 1
            or not self.docqa_lengths
        ):
            raise ValueError(
                f"JointSpec: turns >= 2, reply_tokens >= 1, passage_tokens >= 1 and a docqa "
                f"length are needed (got {self.turns}, {self.reply_tokens}, "
                f"{self.passage_tokens}, {list(self.docqa_lengths)})"
            )


@dataclass(frozen=True)
class Conversation:
    id: str
    task: str
    messages: tuple[str, ...]
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


def conversations(tok, spec: JointSpec, wheel_dir=None) -> list[Conversation]:
    """The sessions, then the document questions (evenly spaced over lengths, depths, phrasings)."""
    out = (
        [
            Conversation(t.id, "session", (t.user, *t.messages), t.answer, t.meta)
            for t in session_trials(
                tok,
                spec.split,
                spec.sessions,
                spec.turns,
                spec.passage_tokens,
                spec.seed,
                wheel_dir,
            )
        ]
        if spec.sessions
        else []
    )
    if spec.docqa:
        docs = docqa_trials(tok, spec.split, list(spec.docqa_lengths), spec.seed, wheel_dir)
        if spec.docqa > len(docs):
            raise ValueError(
                f"JointSpec.docqa: the split has {len(docs)} document questions at lengths "
                f"{list(spec.docqa_lengths)} (asked {spec.docqa})"
            )
        picked = [docs[i * len(docs) // spec.docqa] for i in range(spec.docqa)]
        out += [Conversation(t.id, "docqa", (t.user,), t.answer, t.meta) for t in picked]
    return out


@dataclass(frozen=True)
class Send:
    """How a play sends every turn: `kv_evict` the per-request ``custom_params.kv_evict`` (None:
    the server's flags), request ids ``{rid_prefix}-{conversation}-t{turn}``, greedy replies of
    at most `max_tokens`, `timeout` seconds a request."""

    kv_evict: dict | None = None
    rid_prefix: str = "chat"
    max_tokens: int = 48
    timeout: float = 1800.0

    def stream(
        self,
        http: requests.Session,
        base_url: str,
        model: str,
        messages: list[dict],
        conversation: str,
        turn: int,
    ) -> tuple[dict, dict]:
        """Turn `turn` of `conversation` (`messages`, the history with it) as one streamed chat
        completion: its `http_client.stream_chat` record (with `kv_evict`) and its payload."""
        rid = f"{self.rid_prefix}-{conversation}-t{turn}"
        payload = chat_payload(model, messages, self.max_tokens, rid, self.kv_evict)
        return stream_chat(http, base_url, payload, self.timeout, kv_evict=True), payload


def chat_turn(
    http: requests.Session,
    base_url: str,
    model: str,
    messages: list[dict],
    send: Send,
    conversation: str,
    turn: int,
    t0: float,
) -> dict:
    """One streamed turn of `conversation` re-sending `messages` (`send`): its request record,
    with its `reply` and history figures (`history_fields`). Times are seconds since `t0`."""
    rec, payload = send.stream(http, base_url, model, messages, conversation, turn)
    rec.update(history_fields(rec.pop("kv_evict")))
    rec["reply"] = rec.pop("text")
    rec.update(
        kind="request",
        conversation=conversation,
        turn=turn,
        rid=payload["rid"],
        t_start=round(rec["t_start"] - t0, 4),
        t_end=round(time.monotonic() - t0, 4),
    )
    return rec


def play_all(items: list, play_one, concurrency: int = 0) -> tuple[list[dict], list[dict], float]:
    """``play_one(item, t0) -> (request records, answer record)`` for every item in its own
    thread (at most `concurrency` at once; 0: all); returns the request records (time order),
    the answer records (item order) and the wall seconds."""
    slots = threading.Semaphore(concurrency) if concurrency else None
    t0 = time.monotonic()

    def one(item):
        if slots is None:
            return play_one(item, t0)
        with slots:
            return play_one(item, t0)

    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        results = list(pool.map(one, items))
    wall = time.monotonic() - t0
    reqs = sorted((r for rs, _ in results for r in rs), key=lambda r: r["t_start"])
    return reqs, [a for _, a in results], wall


def play_turns(
    base_url: str, model: str, conv_id: str, turns, send: Send, t0: float, messages=(), replies=None
) -> tuple[list[dict], str, bool, int]:
    """Conversation `conv_id`'s `turns` ((role, text)) after `messages` (e.g. a system prompt),
    one `chat_turn` each in one HTTP session, each reply fed back (``replies[(conv_id, turn)]``
    instead where given); it stops at a failed turn. Returns the request records, the last
    reply, whether a turn failed and the most device KV a turn held."""
    http = requests.Session()
    messages, recs, reply, kv = list(messages), [], "", 0
    for turn, (role, text) in enumerate(turns, start=1):
        messages.append({"role": role, "content": text})
        rec = chat_turn(http, base_url, model, messages, send, conv_id, turn, t0)
        reply = rec["reply"]
        recs.append(rec)
        if rec["error"] is not None:
            break
        kv = max(kv, held_tokens(rec))
        said = (replies or {}).get((conv_id, turn), reply)
        messages.append({"role": "assistant", "content": said})
    return recs, reply, any(r["error"] is not None for r in recs), kv


def _conversation(
    base_url: str, model: str, conv: Conversation, send: Send, t0: float
) -> tuple[list[dict], dict]:
    turns = [("user", text) for text in conv.messages]
    recs, reply, failed, kv = play_turns(base_url, model, conv.id, turns, send, t0)
    for r in recs:
        del r["reply"]
    return recs, answer_record(conv, reply, failed, kv)


def history_fields(report: dict | None) -> dict:
    """A request's history figures from its ``usage.kv_evict`` `report` (None: it carried none,
    as without the plugin or under ``--kv-evict none``). `history_source`: the report's "device"
    (it continued a stored history in the device tree), "host" (one restored from host memory)
    or "none" (prefilled whole); a report that names none says "device" when it continued a
    history (`history_tokens` > 0), else "none"; None without a report.
    `history_restored_tokens`: tokens copied back from host memory (0 when absent)."""
    if report is None:
        return {"history_source": None, "history_restored_tokens": 0}
    source = report.get("history_source") or ("device" if report.get("history_tokens") else "none")
    return {
        "history_source": source,
        "history_restored_tokens": report.get("history_restored_tokens") or 0,
    }


def held_tokens(rec: dict) -> int:
    """Device KV tokens request record `rec` held at its end: `live_tokens` after its last
    eviction; without one, the stored view it continued (`history_view_tokens`, 0 for none) plus
    the prompt tokens past that history and its reply (without the plugin or a stored history:
    the whole prompt and reply)."""
    if rec["live_tokens"] is not None:
        return rec["live_tokens"]
    past = (rec["prompt_tokens"] or 0) - (rec.get("history_tokens") or 0)
    return (rec.get("history_view_tokens") or 0) + past + rec["completion_tokens"]


def host_counters(state: dict | None) -> dict | None:
    """`HOST_COUNTERS` and `host_histories_held` of a plugin state reading (0 for those a server
    does not report); None when `state` is None (no plugin)."""
    if state is None:
        return None
    return {k: state.get(k) or 0 for k in (*HOST_COUNTERS, "host_histories_held")}


def host_moved(before: dict | None, after: dict | None) -> dict | None:
    """What a repeat moved: each `HOST_COUNTERS` entry's growth from the `host_counters` reading
    `before` to `after`, and `host_histories_held` at its end; None when either is None."""
    if before is None or after is None:
        return None
    return {
        **{k: after[k] - before[k] for k in HOST_COUNTERS},
        "host_histories_held": after["host_histories_held"],
    }


def answer_record(conv: Conversation, reply: str, failed: bool, kv_tokens: int) -> dict:
    """A conversation's score: right (`hit`) when no turn failed and the first number written in
    the last reply is the number its fact planted (`conv.answer`; a partial "677" for "67712" is
    a miss); `kv_tokens`: the most device KV any of its turns held."""
    return {
        "kind": "answer",
        "conversation": conv.id,
        "task": conv.task,
        "expected": conv.answer,
        "reply": reply,
        "number": first_number(reply),
        "hit": not failed and exact_number(reply, conv.answer),
        "failed": failed,
        "kv_tokens": kv_tokens,
        **{k: conv.meta.get(k) for k in ("depth", "fact_turn", "length")},
    }


def play(
    base_url: str, model: str, convs: list[Conversation], send: Send, concurrency: int = 0
) -> tuple[list[dict], list[dict], float]:
    """Play every conversation (each turn as `send` says; at most `concurrency` at once; 0: all);
    returns the request records (time order), the answer records (conversation order) and the
    wall seconds."""
    return play_all(
        convs, lambda conv, t0: _conversation(base_url, model, conv, send, t0), concurrency
    )


def history_turns(reqs: list[dict]) -> dict:
    """The answered later turns (turn > 1) by how their history came back: `turns_from_device`
    and `turns_from_host` by their `history_source` (both None when no request carried a report:
    stock, the full cache); of the others, `turns_from_prefix` when SGLang's radix cache held at
    least the previous turn's prompt (`cached_tokens` >= its `prompt_tokens`), else
    `turns_prefilled_again`. The four add up to the answered later turns."""
    prompts = {(r.get("conversation"), r.get("turn")): r["prompt_tokens"] or 0 for r in reqs}
    reported = any(r.get("history_source") is not None for r in reqs if r["error"] is None)
    kinds = ("device", "host", "prefix", "prefilled_again")
    count = dict.fromkeys(kinds, 0)
    for r in reqs:
        turn = r.get("turn", 1)
        if r["error"] is not None or turn < 2:
            continue
        source = r.get("history_source")
        if source in ("device", "host"):
            count[source] += 1
        elif (r["cached_tokens"] or 0) >= prompts.get((r.get("conversation"), turn - 1), 0):
            count["prefix"] += 1
        else:
            count["prefilled_again"] += 1
    out: dict[str, int | None] = {
        ("turns_prefilled_again" if k == "prefilled_again" else f"turns_from_{k}"): n
        for k, n in count.items()
    }
    if not reported:
        out["turns_from_device"] = out["turns_from_host"] = None
    return out


def _rate(hits: list[bool]) -> float | None:
    return round(sum(hits) / len(hits), 4) if hits else None


ACCURACY_BY_TASK = {
    "accuracy_session": lambda a: a["task"] == "session",
    "accuracy_docqa": lambda a: a["task"] == "docqa",
}


def summarize(
    reqs: list[dict],
    answers: list[dict],
    wall: float,
    log: str | None = None,
    reference: list[dict] | None = None,
    host: dict | None = None,
    count_key: str = "conversations",
    accuracy_by: dict = ACCURACY_BY_TASK,
) -> dict:
    """One run's figures over its answered requests; `reference`: the full cache's answer records
    of the same conversations (agreement = the same first number in the last reply); `log`: the
    server's log of the run; `host`: `host_moved` over the run (None: no plugin state);
    `count_key`: the name of the answer count; `accuracy_by`: an accuracy per group of answers
    (name: which answers).

    Later turns by how their history came back (`history_turns`). `host_bytes_per_turn`: bytes
    moved to host and back to the device over the run, per answered request."""
    ok = [r for r in reqs if r["error"] is None]
    moved = (host or {}).get("host_bytes_to_host", 0) + (host or {}).get("host_bytes_to_device", 0)
    out_tokens = sum(r["completion_tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    ref = {a["conversation"]: a["number"] for a in reference or []}
    agree = [a["number"] == ref[a["conversation"]] for a in answers if a["conversation"] in ref]
    kv = [a["kv_tokens"] for a in answers if not a["failed"]]
    return {
        count_key: len(answers),
        "requests": len(reqs),
        "failed": len(reqs) - len(ok),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 2),
        # the prompt tokens the server computed: what neither its cache nor a history held
        "prefill_tokens": sum((r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0) for r in ok),
        **history_turns(reqs),
        "history_restored_tokens": sum(r.get("history_restored_tokens") or 0 for r in ok),
        "host_bytes_per_turn": round(moved / len(ok), 1) if host is not None and ok else None,
        **{k: (host or {}).get(k) for k in (*HOST_COUNTERS, "host_histories_held")},
        "output_tokens_per_s": round(out_tokens / wall, 3) if wall > 0 else None,
        "mean_ttft_ms": round(1000 * statistics.mean(ttft), 1) if ttft else None,
        "accuracy": _rate([a["hit"] for a in answers]),
        **{k: _rate([a["hit"] for a in answers if which(a)]) for k, which in accuracy_by.items()},
        "agreement": _rate(agree) if reference is not None else None,
        "kv_tokens_mean": round(statistics.mean(kv), 1) if kv else None,
        "kv_tokens_max": max(kv) if kv else None,
        "retractions": retracted_requests(log) if log is not None else None,
        "peak_running": peak_running_from_log(log) if log is not None else None,
        # the rows a decode step carried, on average: what the pool let run at once
        "mean_running": mean_running_from_log(log) if log is not None else None,
    }
