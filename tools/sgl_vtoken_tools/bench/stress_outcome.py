"""What came back for one stress request: its outcome, from the HTTP status and finish reason.

Every request is greedy with `ignore_eos`, so a request that finished normally produced exactly
its `max_new_tokens`. Outcomes: `ok` (finished), `clipped` (a request that opted out of eviction
stopped at the length SGLang fitted to the pool: its prompt and `max_new_tokens` exceed it),
`aborted` (finish reason abort: only expected for `abort` and `disconnect`), `rejected` (HTTP
400: only expected for `invalid`), `unavailable` (HTTP 503 naming a KV page shortage: the
plugin's answer to a request it has no page for, patches/core/shortage.py), `error` (anything
else: an unexpected status, a timeout, a short reply, a connection failure).
"""

from __future__ import annotations


def sampling(max_new: int, kv: dict | None) -> dict:
    sp = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    if kv is not None:
        sp["custom_params"] = {"kv_evict": kv}
    return sp


def refusal(code: int, text: str) -> str:
    """The outcome of a request the server answered with an error `code` and body `text`."""
    if code == 400:
        return "rejected"
    return "unavailable" if code == 503 and "kv_evict" in text else "error"


def refused(rec: dict, r) -> dict:
    return {**rec, "status": refusal(r.status_code, r.text), "error": r.text[:300]}


def outcome(rec: dict, finish, completion: int, max_new: int) -> dict:
    """`finish`: a finish reason's type, or /generate's finish-reason object."""
    reason = finish if isinstance(finish, dict) else {}
    finish = reason.get("type") if isinstance(finish, dict) else finish
    if finish == "abort" and reason.get("status_code") == 503:  # a shortage the server answered
        rec.update(
            status=refusal(503, str(reason.get("message"))), error=str(reason.get("message"))[:300]
        )
    elif finish == "abort":
        rec["status"] = "aborted"
    elif finish == "length" and completion < max_new and rec.get("evict") == "none":
        # SGLang fits an opted-out request's max_new_tokens to the pool (prompt + reply): not
        # an error, and not expected of a request that evicts.
        rec["status"] = "clipped"
    elif completion != max_new:
        rec.update(
            status="error", error=f"{completion} tokens of {max_new}, finish reason {finish!r}"
        )
    else:
        rec["status"] = "ok"
    rec.update(finish_reason=finish, completion_tokens=completion)
    return rec


def evicted(meta: dict) -> int:
    return sum(e.get("evicted_tokens") or 0 for e in (meta.get("kv_evict") or []))
