"""The requests of a stress run, each drawn from a seeded random stream and played as one
record: what was sent (kind, eviction settings, lengths) and what came back (status, tokens,
evictions, finish reason: `stress_outcome`). `stress_spec.KINDS` lists them; `play(kind, ...)`
runs one.

A request's `kv_evict` overrides any of the fields a request may carry (policy, budget, sink,
window, interval, and on a server with a host store offload and recall), each drawn from the
spec's values, which the caller keeps valid for the server (`stress_spec.TrafficSpec`); `invalid` requests
send one bad value of one field (or an unknown field) and expect HTTP 400.
"""

from __future__ import annotations

import json
import random
import time

import requests

from sgl_vtoken_tools.bench.stress_outcome import evicted, outcome, refusal, refused, sampling
from sgl_vtoken_tools.bench.stress_spec import (
    FORCED,
    INVALID,
    TrafficSpec,
    evict_choice,
    kinds,
    prompt_ids,
)
from sgl_vtoken_tools.bench.workload import prose


def generate(
    base_url: str,
    rec: dict,
    ids: list[int],
    max_new: int,
    kv,
    stream: bool,
    stop_after: int = 0,
    abort: bool = False,
    timeout: float = 300.0,
) -> dict:
    """/generate; with `stop_after` > 0 (streaming), after that many chunks either POST
    /abort_request (`abort`) or drop the connection (a client disconnect)."""
    body = {
        "rid": rec["rid"],
        "input_ids": ids,
        "sampling_params": sampling(max_new, kv),
        "stream": stream,
    }
    with requests.post(base_url + "/generate", json=body, stream=stream, timeout=timeout) as r:
        rec["http"] = r.status_code
        if r.status_code != 200:
            return refused(rec, r)
        if not stream:
            j = r.json()
            meta = j["meta_info"]
            rec["evicted_tokens"] = evicted(meta)
            return outcome(rec, meta.get("finish_reason"), meta["completion_tokens"], max_new)
        last, chunks = None, 0
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            last = json.loads(line[5:])
            if (
                "error" in last
            ):  # refused after the stream began (SGLang answers 200, then the error)
                err = last["error"] if isinstance(last["error"], dict) else last
                return {
                    **rec,
                    "status": refusal(int(err.get("code") or 0), json.dumps(err)),
                    "error": json.dumps(err)[:300],
                }
            chunks += 1
            if stop_after and chunks == stop_after:
                if not abort:
                    rec.update(status="aborted", finish_reason="disconnect", completion_tokens=None)
                    return rec  # leaving the with-block closes the connection
                requests.post(base_url + "/abort_request", json={"rid": rec["rid"]}, timeout=30)
    if last is None:
        return {**rec, "status": "error", "error": "stream without data"}
    meta = last["meta_info"]
    rec["evicted_tokens"] = evicted(meta)
    return outcome(rec, meta.get("finish_reason"), meta["completion_tokens"], max_new)


def chat(
    base_url: str,
    rec: dict,
    messages: list[dict],
    max_new: int,
    kv,
    stream: bool,
    timeout: float = 300.0,
    model: str = "default",
) -> tuple[dict, str]:
    """One chat completion; returns the record and the reply text."""
    body = {
        "rid": rec["rid"],
        "model": model,
        "messages": messages,
        "max_tokens": max_new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if kv is not None:
        body["custom_params"] = {"kv_evict": kv}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with requests.post(
        base_url + "/v1/chat/completions", json=body, stream=stream, timeout=timeout
    ) as r:
        rec["http"] = r.status_code
        if r.status_code != 200:
            return refused(rec, r), ""
        if not stream:
            j = r.json()
            c = j["choices"][0]
            return outcome(rec, c["finish_reason"], j["usage"]["completion_tokens"], max_new), c[
                "message"
            ]["content"] or ""
        parts, finish, completion = [], None, None
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("object") == "error" or "error" in obj:  # an error after the stream began
                err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
                return {
                    **rec,
                    "status": refusal(int(err.get("code") or 0), json.dumps(err)),
                    "error": json.dumps(err)[:300],
                }, ""
            for c in obj.get("choices") or []:
                parts.append((c.get("delta") or {}).get("content") or "")
                finish = c.get("finish_reason") or finish
            if obj.get("usage"):
                completion = obj["usage"]["completion_tokens"]
    return outcome(rec, finish, completion, max_new), "".join(parts)


def play(
    kind: str,
    base_url: str,
    rng: random.Random,
    spec: TrafficSpec,
    rid: str,
    model: str = "default",
) -> list[dict]:
    """One request of `kind` (a `session` is several), drawn from `rng`; its records."""
    if kind not in kinds(spec):
        raise ValueError(f"unknown kind {kind!r}; choose from {sorted(kinds(spec))}")
    long = rng.random() < 0.3
    kv = evict_choice(rng, spec)
    lo, hi = spec.long_new if rng.random() < 0.3 else spec.short_new
    max_new = rng.randint(lo, hi)
    rec = {
        "kind": kind,
        "rid": rid,
        "evict": "server" if kv is None else kv["policy"],
        "kv_evict": kv,
        "long_prompt": long,
        "max_new": max_new,
        "error": None,
    }
    t0 = time.monotonic()
    try:
        if kind in ("generate", "generate_stream", "abort", "disconnect"):
            cut = kind in ("abort", "disconnect")  # the client stops reading after a few chunks
            n_new = max(max_new, 64) if cut else max_new
            ids = prompt_ids(rng, spec, long)
            how = {"stop_after": rng.randint(1, 8), "abort": kind == "abort"} if cut else {}
            stream = kind != "generate"
            out = [generate(base_url, rec, ids, n_new, kv, stream, **how, timeout=spec.timeout)]
            if cut:
                out[0]["max_new"] = n_new
        elif kind == "over_pool":
            # The server's own setting: evicted during prefill where it has `prefill_chunk`.
            n, max_new = rng.randint(*spec.over_pool), rng.randint(1, 16)
            rec.update(
                evict="server",
                kv_evict=None,
                long_prompt=True,
                max_new=max_new,
                prompt_tokens=n,
                expected=["ok", "unavailable"] if spec.over_pool_served else ["rejected"],
            )
            ids = [rng.randrange(*spec.vocab) for _ in range(n)]
            out = [generate(base_url, rec, ids, max_new, None, False, timeout=spec.timeout)]
        elif kind == "invalid":
            bad = rng.choice(INVALID)
            out = [
                generate(
                    base_url, rec, prompt_ids(rng, spec, False), 4, bad, False, timeout=spec.timeout
                )
            ]
        elif kind in ("chat", "chat_stream"):
            words = int(
                rng.randint(*(spec.long_prompt if long else spec.short_prompt))
                * spec.words_per_token
            )
            msgs = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": prose(rng, max(1, words))},
            ]
            out = [
                chat(base_url, rec, msgs, max_new, kv, kind == "chat_stream", spec.timeout, model)[
                    0
                ]
            ]
        elif kind == "shortage":
            page_kind = rng.choice(spec.shortages)
            rec.update(rid=f"{FORCED}{page_kind}-{rid}")
            if page_kind == "copies":
                out = _cached_prompt_evicted(base_url, rng, spec, rec)
            else:
                out = _session(base_url, rng, spec, rec, kv, model)
        else:
            out = _session(base_url, rng, spec, rec, kv, model)
    except (requests.RequestException, ValueError, KeyError) as e:
        out = [{**rec, "status": "error", "error": f"{type(e).__name__}: {e}"[:300]}]
    for r in out:
        r.setdefault("latency_s", round(time.monotonic() - t0, 3))
    return out


def _cached_prompt_evicted(
    base_url: str, rng: random.Random, spec: TrafficSpec, rec: dict
) -> list[dict]:
    """A long prompt cached by a first request without eviction, then sent again (a prefix hit)
    with Random eviction at a small budget: it keeps scattered tokens of the cached pages, so at
    page size > 1 the partly kept ones need copies (the `copies` page kind) in the first eviction,
    during prefill with a server `prefill_chunk`, else at decode."""
    ids = prompt_ids(rng, spec, True)
    off = {"policy": "none"}
    first = generate(
        base_url,
        {**rec, "rid": f"{rec['rid']}-cache", "kv_evict": off},
        ids,
        1,
        off,
        False,
        timeout=spec.timeout,
    )
    if first["status"] != "ok":
        return [first]
    kv = {"policy": "random", "budget": min(spec.budgets)}
    again = {
        **rec,
        "rid": f"{rec['rid']}-hit",
        "evict": "random",
        "kv_evict": kv,
        "long_prompt": True,
        "max_new": 64,
    }
    return [first, generate(base_url, again, ids, 64, kv, False, timeout=spec.timeout)]


def _session(
    base_url: str, rng: random.Random, spec: TrafficSpec, rec: dict, kv, model: str
) -> list[dict]:
    """2 to 4 turns of chat, each re-sending the history (same eviction settings every turn)."""
    msgs = [
        {
            "role": "system",
            "content": "You are an agent. " + prose(random.Random("session-system"), 120),
        }
    ]
    out = []
    for turn in range(rng.randint(2, 4)):
        msgs.append(
            {
                "role": "user",
                "content": prose(
                    rng, max(1, int(rng.randint(*spec.short_prompt) * spec.words_per_token))
                ),
            }
        )
        r, text = chat(
            base_url,
            {**rec, "rid": f"{rec['rid']}-t{turn}", "turn": turn},
            msgs,
            rec["max_new"],
            kv,
            rng.random() < 0.5,
            spec.timeout,
            model,
        )
        out.append(r)
        if r["status"] != "ok":
            break
        msgs.append({"role": "assistant", "content": text})
    return out
