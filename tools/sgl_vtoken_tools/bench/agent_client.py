"""Plays one agent session against a server: one streaming chat completion per turn, each
re-sending the whole history, each reply appended to it (`run_session`)."""

from __future__ import annotations

import hashlib
import threading
import time

import requests

from sgl_vtoken_tools.bench import http_client
from sgl_vtoken_tools.bench.http_client import stream_chat
from sgl_vtoken_tools.bench.workload import Session


def request_id(prefix: str | None, session: int, turn: int) -> str | None:
    """The fixed request id of a session's turn (None without a prefix: the server picks one).
    Fixed ids make seeded per-request choices (the `random` policy's victims, seeded from the
    request id) the same on every server that plays the same workload."""
    return None if prefix is None else f"{prefix}-s{session}-t{turn}"


def output_hash(text: str) -> str:
    """A short digest of a reply, to compare outputs across servers without storing them."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def chat_payload(cfg, messages: list[dict], rid: str | None) -> dict:
    """The chat completion body of one turn under an `agent.AgentConfig`."""
    payload = http_client.chat_payload(
        cfg.model, messages, cfg.reply_tokens, rid, cfg.kv_evict, cfg.temperature
    )
    return {**payload, "ignore_eos": True} if cfg.ignore_eos else payload


def run_session(
    sess: Session, system: str, cfg, t0: float, on_done, slots: threading.Semaphore | None
) -> list[dict]:
    """Wait for the session's start, then play its turns (holding one of `slots`, if given)."""
    delay = t0 + sess.start - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    if slots is None:
        return _session_turns(sess, system, cfg, t0, on_done)
    with slots:
        return _session_turns(sess, system, cfg, t0, on_done)


def _session_turns(sess: Session, system: str, cfg, t0: float, on_done) -> list[dict]:
    """Every turn of one session, each request record passed to `on_done`; stops at an error."""
    http = requests.Session()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": sess.user}]
    out = []
    for turn in range(1, cfg.workload.turns + 1):
        if turn > 1:
            if cfg.think_time > 0:
                time.sleep(cfg.think_time)
            content = sess.tools[turn - 2]
            if cfg.tool_role == "user":
                content = "Tool output:\n" + content
            messages.append({"role": cfg.tool_role, "content": content})
        rid = request_id(cfg.rid_prefix, sess.index, turn)
        rec = stream_chat(http, cfg.base_url, chat_payload(cfg, messages, rid), cfg.request_timeout)
        text = rec.pop("text")
        rec.update(
            kind="request",
            session=sess.index,
            turn=turn,
            rid=rid,
            output_hash=output_hash(text),
            t_start=round(rec["t_start"] - t0, 4),
            t_end=round(time.monotonic() - t0, 4),
        )
        out.append(rec)
        on_done(rec)
        if rec["error"] is not None:
            break  # the session cannot continue without the reply
        messages.append({"role": "assistant", "content": text})
    return out
