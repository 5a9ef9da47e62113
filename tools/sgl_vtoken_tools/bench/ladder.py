"""The load ladder (`python -m sgl_vtoken_tools ladder`): scored chat and agent sessions that arrive at
Poisson rates, the rate set as a fraction of what the KV pool holds, played through
`/v1/chat/completions` as chat clients send them (the whole conversation re-sent as text every
turn, the server's own reply fed back, streamed: TTFT and TPOT per request).

    Session                       one scored session of either kind: its system prompt (agents),
                                  user turns, key, max_tokens and peak KV
    chat_session / agent_session  a `chat_conversations.Conversation` or
                                  `agent_sessions.AgentSession` as a Session, its peak KV
                                  counted with the model's tokenizer
    mix_counts(n, chat, agent)    how many of `n` sessions are chats at a chat:agent ratio
    arrival_order(sessions, seed) the sessions in a seeded arrival order
    unit_arrivals(n, seed)        seeded Poisson arrival times at rate 1 (first at 0, mean gap
                                  exactly 1); at rate r they are divided by r, so every rate
                                  plays the same schedule
    rate_for_load(load, pool, sessions, s_per_token)
                                  the arrival rate that offers `load` (module docstring of the
                                  script: load = rate x mean duration x mean peak KV / pool)
    decode_seconds_per_token(...) a server's least TPOT alone (the duration estimate's time per
                                  token)
    play_load(...)                every session from its arrival time on, turn by turn
    score(sessions, reqs)         answer records: each kind's own scoring (`chat_rounds.score`,
                                  `agent_chat.answer_record`), leaks across all sessions' keys
    cell_line(...)                one (cell, load, repeat)'s figures
    table(cells), plot(cells, path)
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from sgl_vtoken_tools.bench import chat_rounds
from sgl_vtoken_tools.bench.agent_chat import answer_record
from sgl_vtoken_tools.bench.chat_conversations import Conversation, peak_tokens
from sgl_vtoken_tools.bench.chat_rounds import new_state, send_turn
from sgl_vtoken_tools.bench.http_client import stream_chat
from sgl_vtoken_tools.bench.joint import Send, held_tokens
from sgl_vtoken_tools.bench.plots import pyplot, save
from sgl_vtoken_tools.bench.quantiles import median_text, percentiles, spread
from sgl_vtoken_tools.quality.agent_sessions import SYSTEM

KINDS = ("chat", "agent")
PROBE_PROMPT = "Count from one to two hundred in words, separated by commas."


@dataclass(frozen=True)
class Session:
    """`turns`: the user messages in order (an agent's tool outputs go as user messages, as
    `python -m sgl_vtoken_tools agent` sends them by default); `system`: the agents' shared
    system prompt (None for chats); `peak_tokens`: its longest prompt + `max_tokens`
    (`chat_conversations.peak_tokens`); `source`: the Conversation or AgentSession it was made
    from (scored by its kind's rules)."""

    id: str
    kind: str
    system: str | None
    turns: tuple[str, ...]
    key: str
    max_tokens: int
    peak_tokens: int
    source: object = field(compare=False, repr=False)

    def messages(self) -> list[dict]:
        """The system prompt (when any) and every user turn, replies left out."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": t} for t in self.turns]


def chat_session(conv: Conversation, tok, max_tokens: int) -> Session:
    turns = tuple(conv.messages)
    msgs = [{"role": "user", "content": t} for t in turns]
    return Session(
        conv.id, "chat", None, turns, conv.key, max_tokens, peak_tokens(tok, msgs, max_tokens), conv
    )


def agent_session(sess, tok, max_tokens: int) -> Session:
    turns = tuple(text for _, text in sess.turns)
    msgs = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": t} for t in turns]
    peak = peak_tokens(tok, msgs, max_tokens)
    return Session(sess.id, "agent", SYSTEM, turns, sess.answer, max_tokens, peak, sess)


def mix_counts(n: int, chat: int, agent: int) -> tuple[int, int]:
    """(chats, agents) of `n` sessions at a chat:agent ratio (chats rounded half up).

    Raises:
        ValueError: n < 1, a negative part or both parts 0."""
    if n < 1 or chat < 0 or agent < 0 or chat + agent == 0:
        raise ValueError(f"need n >= 1 and a ratio with a positive part (got {n}, {chat}:{agent})")
    chats = int(n * chat / (chat + agent) + 0.5)
    return chats, n - chats


def arrival_order(sessions: list[Session], seed: int) -> list[Session]:
    """The sessions shuffled by `seed` alone: the same order in every cell and at every load."""
    out = list(sessions)
    random.Random(f"ladder/{seed}/order").shuffle(out)
    return out


def unit_arrivals(n: int, seed: int) -> list[float]:
    """`n` arrival times from `seed` at rate 1: the first at 0, gaps drawn from Exp(1) and
    scaled so that their mean is exactly 1 (the last at n - 1): a Poisson process conditioned on
    its count, so that at rate r the sessions arrive over exactly (n - 1) / r seconds and offer
    the load r was chosen for (12 unscaled draws can span anywhere from 5 to 20). At rate r
    session i arrives at ``unit[i] / r``."""
    rng = random.Random(f"ladder/{seed}/arrivals")
    gaps = [rng.expovariate(1.0) for _ in range(max(n - 1, 0))]
    scale = len(gaps) / sum(gaps) if gaps else 1.0
    times, t = [0.0] if n else [], 0.0
    for g in gaps:
        t += g * scale
        times.append(t)
    return times


def session_seconds(s: Session, s_per_token: float) -> float:
    """A session's duration estimate: every turn's reply at `max_tokens`, `s_per_token` each."""
    return len(s.turns) * s.max_tokens * s_per_token


def rate_for_load(load: float, pool: int, sessions: list[Session], s_per_token: float) -> float:
    """Sessions per second that offer `load` of a `pool`-token KV pool:
    ``load * pool / (mean session_seconds * mean peak_tokens)`` (Little's law: rate x mean
    duration sessions are in the server at once, each holding up to its peak KV)."""
    if load <= 0 or pool < 1 or s_per_token <= 0 or not sessions:
        raise ValueError(f"need load, pool, s_per_token > 0 and sessions (got {load}, {pool})")
    mean_s = sum(session_seconds(s, s_per_token) for s in sessions) / len(sessions)
    mean_kv = sum(s.peak_tokens for s in sessions) / len(sessions)
    return load * pool / (mean_s * mean_kv)


def decode_seconds_per_token(
    base_url: str, model: str, tokens: int = 32, probes: int = 3, timeout: float = 600.0
) -> float:
    """The least TPOT of `probes` greedy requests sent alone one after another (`tokens` tokens
    each, EOS ignored), after one that warms the server up: the least is the one other processes
    on the machine slowed least.

    Raises:
        RuntimeError: a probe failed or returned too few tokens."""
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    seen = []
    with requests.Session() as http:
        for _ in range(probes + 1):
            rec = stream_chat(http, base_url, payload, timeout)
            if rec["error"] is not None or rec["tpot"] is None:
                raise RuntimeError(f"decode probe failed: {rec['error'] or rec}")
            seen.append(rec["tpot"])
    return min(seen[1:])


def play_load(
    base_url: str,
    model: str,
    sessions: list[Session],
    times: list[float],
    kv_evict: dict | None = None,
    rid_prefix: str = "ladder",
    timeout: float = 1800.0,
) -> tuple[list[dict], float]:
    """Session i starts at `times[i]` seconds (one thread each) and plays its turns one after
    another with no pause, each reply fed back (`chat_rounds.send_turn`, request ids
    ``{rid_prefix}-{session id}-t{turn}``); a session stops at a failed turn. Request records
    (time order) gain `session_kind` and `arrival_s`; wall seconds from the first arrival to
    the last reply."""
    t0 = time.monotonic()

    def one(i: int) -> list[dict]:
        s = sessions[i]
        time.sleep(max(0.0, t0 + times[i] - time.monotonic()))
        send = Send(kv_evict, rid_prefix, s.max_tokens, timeout)
        state = new_state([{"role": "system", "content": s.system}] if s.system else [])
        recs = []
        for turn, content in enumerate(s.turns, start=1):
            rec = send_turn(base_url, model, s.id, content, state, turn, send, t0)
            recs.append({**rec, "session_kind": s.kind, "arrival_s": round(times[i], 4)})
            if not state["alive"]:
                break
        state["http"].close()
        return recs

    with ThreadPoolExecutor(max_workers=max(1, len(sessions))) as pool:
        results = list(pool.map(one, range(len(sessions))))
    wall = time.monotonic() - t0
    return sorted((r for rs in results for r in rs), key=lambda r: r["t_start"]), wall


def score(sessions: list[Session], reqs: list[dict]) -> list[dict]:
    """One answer record per session (`sessions`' order) with `session_kind`: chats scored as
    `chat_rounds.score` does (the first 5-digit number of the last reply is the key), agents as
    `agent_chat.answer_record` (the first number is the whole key). Every request record gets
    `leaked`: the other sessions' keys its reply writes (`chat_rounds.foreign_keys`), and each
    answer the count of its session's replies with one (`leaks`)."""
    chats = [s for s in sessions if s.kind == "chat"]
    ids = {s.id for s in chats}
    scored = chat_rounds.score(
        [s.source for s in chats], [r for r in reqs if r["conversation"] in ids]
    )
    by_chat = {a["conversation"]: a for a in scored}
    keys = {s.key for s in sessions}
    key_of = {s.id: s.key for s in sessions}
    for r in reqs:
        r["leaked"] = chat_rounds.foreign_keys(
            r.get("reply") or "", key_of[r["conversation"]], keys
        )
    out = []
    for s in sessions:
        mine = sorted((r for r in reqs if r["conversation"] == s.id), key=lambda r: r["turn"])
        if s.kind == "chat":
            a = by_chat[s.id]
        else:
            failed = any(r["error"] is not None for r in mine) or len(mine) < len(s.turns)
            last = mine[-1] if mine else None
            reply = last["reply"] if last and last["turn"] == len(s.turns) else ""
            kv = max((held_tokens(r) for r in mine if r["error"] is None), default=0)
            a = answer_record(s.source, reply, failed, kv)
        a["leaks"] = sum(bool(r["leaked"]) for r in mine)
        out.append({**a, "session_kind": s.kind})
    return out


def tpot(rec: dict) -> float | None:
    """Seconds per output token after the first: (latency - TTFT) / (completion tokens - 1)."""
    n = rec["completion_tokens"]
    if rec["error"] is not None or rec["ttft"] is None or n < 2:
        return None
    return (rec["latency"] - rec["ttft"]) / (n - 1)


def versus_full(answers: list[dict], full: list[dict] | None) -> dict | None:
    """The full cache's answers on the same sessions (same load and repeat): `full` its hits,
    `same_number` the sessions whose answer wrote the same first number as the full cache's
    (neither failed), of `sessions`; None when the full cell did not run."""
    if full is None:
        return None
    ref = {a["conversation"]: a for a in full}
    same = [
        ref[a["conversation"]]
        for a in answers
        if a["conversation"] in ref
        and not a["failed"]
        and not ref[a["conversation"]]["failed"]
        and a["number"] == ref[a["conversation"]]["number"]
    ]
    mine = [ref[a["conversation"]] for a in answers if a["conversation"] in ref]
    return {"full": sum(f["hit"] for f in mine), "same_number": len(same), "sessions": len(mine)}


def replies_vs_full(reqs: list[dict], full: list[dict] | None) -> dict | None:
    """The turns whose reply text is the full cache's for the same session and turn (same load
    and repeat): `same` of `turns`, the turns both answered without error; None when the full
    cell did not run."""
    if full is None:
        return None
    ref = {(r["conversation"], r["turn"]): r["reply"] for r in full if r["error"] is None}
    both = [r for r in reqs if r["error"] is None and (r["conversation"], r["turn"]) in ref]
    same = sum(r["reply"] == ref[(r["conversation"], r["turn"])] for r in both)
    return {"same": same, "turns": len(both)}


def cell_line(
    answers: list[dict],
    reqs: list[dict],
    wall: float,
    log: str | None = None,
    server_evicted: int | None = None,
    full: list[dict] | None = None,
    full_reqs: list[dict] | None = None,
) -> dict:
    """One (cell, load, repeat)'s figures: `chat_rounds.cell_line`'s (answers, leaks, requests,
    failed, output tokens/s over the wall seconds from the first arrival to the last reply,
    prompt tokens sent and computed, evicted tokens from the requests' ``usage.kv_evict``,
    retractions and peak running from the server `log` of this load, later turns by how their
    history came back, mean latency) with `sessions` for its `conversations`, the answers per
    session kind, TTFT and TPOT p50/p95 in ms over the answered requests,
    `answers_vs_full` (`versus_full`) and `replies_vs_full` (`replies_vs_full`, of the full
    cache's requests `full_reqs`)."""
    out = chat_rounds.cell_line(answers, reqs, wall, [], log, server_evicted)
    out.pop("round_s")
    out = {"sessions": out.pop("conversations"), **out}
    for kind in KINDS:
        mine = [a for a in answers if a.get("session_kind") == kind]
        out[f"answers_{kind}"] = sum(a["hit"] for a in mine)
        out[f"sessions_{kind}"] = len(mine)
    ok = [r for r in reqs if r["error"] is None]
    ttft = percentiles([r["ttft"] for r in ok], scale=1000.0, digits=1)
    per_token = percentiles([tpot(r) for r in ok], scale=1000.0, digits=2)
    for name, q in (("ttft", ttft), ("tpot", per_token)):
        out[f"{name}_p50_ms"], out[f"{name}_p95_ms"] = q["p50"], q["p95"]
    out["answers_vs_full"] = versus_full(answers, full)
    out["replies_vs_full"] = replies_vs_full(reqs, full_reqs)
    return out


def _rows(cells: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """Cell lines by (cell, load): cells in first-seen order, loads ascending."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for c in cells:
        groups.setdefault((c["cell"], c["load"]), []).append(c)
    first = list(dict.fromkeys(c["cell"] for c in cells))
    return dict(sorted(groups.items(), key=lambda kv: (first.index(kv[0][0]), kv[0][1])))


def table(cells: list[dict]) -> str:
    """Markdown, one row per (cell, load): the arrival rate, answers over all repeats (with the
    range per repeat), the full cache's on the same sessions, the replies equal to the full
    cache's (all repeats; "-" in lines written without them), output tok/s,
    TTFT and TPOT p50 / p95, retractions, evicted tokens and prompt tokens computed (medians over
    repeats with min-max)."""
    lines = [
        "| cell | load | sessions/s | repeats | answers | full's answers "
        "| replies = full's | output tok/s "
        "| TTFT p50 / p95 (ms) | TPOT p50 / p95 (ms) | retractions | evicted tokens "
        "| prompt tokens computed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (cell, load), rows in _rows(cells).items():
        hits = [r["answers"] for r in rows]
        total = sum(r["sessions"] for r in rows)
        per = "" if min(hits) == max(hits) else f" ({min(hits)}-{max(hits)})"
        full = [r["answers_vs_full"] for r in rows if r.get("answers_vs_full")]
        full_text = (
            f"{sum(f['full'] for f in full)}/{sum(f['sessions'] for f in full)}" if full else "-"
        )
        same = [r["replies_vs_full"] for r in rows if r.get("replies_vs_full")]
        same_text = (
            f"{sum(s['same'] for s in same)}/{sum(s['turns'] for s in same)}" if same else "-"
        )

        def med(key: str, digits: int = 1, rows=rows) -> str:
            return median_text([r[key] for r in rows], digits)

        lines.append(
            f"| {cell} | {load:g} | {rows[0]['rate']:.4g} | {len(rows)} | {sum(hits)}/{total}{per} "
            f"| {full_text} | {same_text} | {med('output_tokens_per_s')} "
            f"| {med('ttft_p50_ms', 0)} / {med('ttft_p95_ms', 0)} "
            f"| {med('tpot_p50_ms')} / {med('tpot_p95_ms')} | {med('retractions', 0)} "
            f"| {med('evicted_tokens', 0)} | {med('prompt_tokens_computed', 0)} |"
        )
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path) -> str:
    """Writes a PNG to `path`: answers (fraction of the sessions, all repeats) and output tok/s
    (median with min-max over repeats) against the offered load, one line per cell; returns
    the path."""
    plt = pyplot()

    by_cell: dict[str, list[tuple[float, list[dict]]]] = {}
    for (cell, load), rows in _rows(cells).items():
        by_cell.setdefault(cell, []).append((load, rows))
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.6))
    for i, (cell, points) in enumerate(by_cell.items()):
        color = f"C{i}"
        loads = [load for load, _ in points]
        frac = [[r["answers"] / r["sessions"] for r in rows if r["sessions"]] for _, rows in points]
        for ax, vals in (
            (axes[0], frac),
            (axes[1], [[r["output_tokens_per_s"] for r in rows] for _, rows in points]),
        ):
            sps = [spread(v) for v in vals]
            mid = [sp["median"] if sp else float("nan") for sp in sps]
            err = [
                [sp["median"] - sp["min"] if sp else 0 for sp in sps],
                [sp["max"] - sp["median"] if sp else 0 for sp in sps],
            ]
            ax.errorbar(
                loads, mid, yerr=err, marker="o", markersize=3, capsize=2, color=color, label=cell
            )
    n = max(len(rows) for _, rows in _rows(cells).items())
    ticks = sorted({load for _, load in _rows(cells)})
    for ax, title, ylabel in (
        (axes[0], "Answers (key recalled)", "fraction of sessions"),
        (axes[1], "Output tokens/s", "tokens/s"),
    ):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("offered load (rate x mean duration x mean peak KV / pool)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].set_ylim(bottom=0)
    fig.suptitle(f"Load ladder: median and min-max of {n} repeat(s)", fontsize=10)
    save(fig, path, 110)
    return str(path)
