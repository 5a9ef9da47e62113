"""Plays scored agent sessions (`sgl_vtoken_tools.quality.agent_sessions`) as a chat client does:
the shared system prompt, then each turn appended to the history with the model's own reply
(greedy, at most `Send.max_tokens` tokens, stops at EOS) fed back, or another run's reply to that
turn (`load_replies`); one streamed chat completion per turn (`http_client.stream_chat`).

    play(...)            every session at once (or `concurrency` at a time): request records in
                         time order, answer records in session order, wall seconds
    answer_record(...)   a session's score: the first number of its last reply against the key
    load_replies(...)    a cell's replies from a run's lines, to feed back instead

Request ids are ``{rid_prefix}-{session id}-t{turn}``, the same on every server, so seeded
per-request choices are the same in every cell. Each request record carries how its history
came back (`joint.history_fields`: `history_source`, `history_restored_tokens`) and its
`reply`. Tool outputs go as role `tool_role`: "user" (default: SmolLM2's template was trained on
user and assistant turns only) or "tool".
"""

from __future__ import annotations

from sgl_vtoken_tools.bench.joint import Send, play_all, play_turns
from sgl_vtoken_tools.quality.agent_sessions import SYSTEM, AgentSession
from sgl_vtoken_tools.quality.tasks import exact_number, first_number


def answer_record(sess: AgentSession, reply: str, failed: bool, kv_tokens: int) -> dict:
    """Right (`hit`) when no turn failed and the first number of the last reply is the whole key
    (a partial "542" for "54288", or "542880", is a miss); `kv_tokens`: the most device KV any of
    the session's turns held."""
    return {
        "kind": "answer",
        "conversation": sess.id,
        "expected": sess.answer,
        "reply": reply,
        "number": first_number(reply),
        "hit": not failed and exact_number(reply, sess.answer),
        "failed": failed,
        "kv_tokens": kv_tokens,
        "turns": len(sess.turns),
        **{k: sess.meta.get(k) for k in ("fact_turn", "phrasing", "depth")},
    }


def load_replies(lines: list[dict], cell: str) -> dict[tuple[str, int], str]:
    """``(session id, turn) -> reply`` of `cell`'s first repeat in a run's JSON `lines` (request
    records with their `reply`), for `play`'s `replies`.

    Raises:
        ValueError: the lines hold no reply of that cell."""
    got = {
        (r["conversation"], r["turn"]): r["reply"]
        for r in lines
        if r.get("kind") == "request"
        and r.get("cell") == cell
        and r.get("repeat") == 0
        and "reply" in r
    }
    if not got:
        raise ValueError(f"no request line of cell {cell!r}, repeat 0, carries a reply")
    return got


def _session(
    base_url: str, model: str, sess: AgentSession, send: Send, t0: float, tool_role: str, replies
) -> tuple[list[dict], dict]:
    turns = [(tool_role if role == "tool" else role, text) for role, text in sess.turns]
    system = [{"role": "system", "content": SYSTEM}]
    recs, reply, failed, kv = play_turns(base_url, model, sess.id, turns, send, t0, system, replies)
    return recs, answer_record(sess, reply, failed, kv)


def play(
    base_url: str,
    model: str,
    sessions: list[AgentSession],
    send: Send,
    tool_role: str = "user",
    concurrency: int = 0,
    replies: dict[tuple[str, int], str] | None = None,
) -> tuple[list[dict], list[dict], float]:
    """Play every session (each turn as `send` says; at most `concurrency` at once; 0: all);
    `replies`: ``(session id, turn) ->
    text`` fed back in the history instead of the server's own reply to that turn (another
    run's, `load_replies`), so two servers answer the same conversation. Returns the request
    records (time order, each with its `reply`), the answer records (session order) and the
    wall seconds.

    Raises:
        ValueError: a bad `tool_role`, or `replies` lacking a turn before a session's last."""
    if tool_role not in ("user", "tool"):
        raise ValueError(f"tool_role must be 'user' or 'tool' (got {tool_role!r})")
    if replies is not None:  # a missing one would silently become the server's own
        missing = [
            (s.id, t) for s in sessions for t in range(1, len(s.turns)) if (s.id, t) not in replies
        ]
        if missing:
            raise ValueError(
                f"replies lack {len(missing)} turns before a session's last, e.g. {missing[0]} "
                "(another split, seed or turn count, or a session that failed there)"
            )
    return play_all(
        sessions,
        lambda sess, t0: _session(base_url, model, sess, send, t0, tool_role, replies or {}),
        concurrency,
    )
