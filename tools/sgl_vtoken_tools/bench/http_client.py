"""Requests to an SGLang server, as timed records: `/generate` and streamed OpenAI chat
completions. Errors become the record's `error` field, never an exception, except
in `generate` (raises on HTTP errors)."""

from __future__ import annotations

import json
import time

import requests


def generate(
    base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float, rid: str | None = None
) -> dict:
    """One greedy `/generate` of `max_new_tokens` tokens (`ignore_eos`); the response JSON.
    Raises `requests.HTTPError` on a non-2xx answer."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    if rid:
        payload["rid"] = rid
    r = requests.post(base_url + "/generate", json=payload, timeout=timeout)
    r.raise_for_status()
    return r.json()


def chat_payload(
    model: str, messages: list[dict], max_tokens: int, rid: str | None, kv_evict=None, temperature=0
) -> dict:
    """A chat completion's body: request id `rid` (None: the server picks one), `kv_evict` the
    per-request ``custom_params.kv_evict`` (None: the server's flags)."""
    payload = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if kv_evict is not None:
        payload["custom_params"] = {"kv_evict": kv_evict}
    if rid is not None:
        payload["rid"] = rid
    return payload


def stream_chat(
    http: requests.Session, base_url: str, payload: dict, timeout: float, kv_evict: bool = False
) -> dict:
    """One streaming `/v1/chat/completions` (`payload` without `stream`; usage is asked for).

    Returns `ttft` (first chunk with a choice: SGLang sends the role with the first token), `e2e`,
    `tpot` = (e2e - ttft) / (completion tokens - 1), `prompt_tokens`, `completion_tokens`,
    `cached_tokens` (SGLang's `--enable-cache-report`), `live_tokens` (device KV the request held
    at its end, from ``usage.kv_evict`` when it evicted; None otherwise), `finish_reason`, the reply `text`,
    `t_start` (monotonic) and `error` (None, or the HTTP status / exception, 300 characters; a
    reply the server aborted is an error too). `kv_evict`: also return the whole
    ``usage.kv_evict`` as `kv_evict` (None when the usage carried none).
    """
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    rec = {
        "ttft": None,
        "e2e": None,
        "prompt_tokens": None,
        "completion_tokens": 0,
        "cached_tokens": None,
        "history_tokens": 0,
        "history_view_tokens": 0,
        "live_tokens": None,
        "finish_reason": None,
        "error": None,
    }
    if kv_evict:
        rec["kv_evict"] = None
    parts: list[str] = []
    t0 = time.monotonic()
    rec["t_start"] = t0
    try:
        with http.post(
            base_url + "/v1/chat/completions", json=payload, stream=True, timeout=(10, timeout)
        ) as r:
            if r.status_code != 200:
                rec.update(
                    error=f"HTTP {r.status_code}: {r.text[:300]}",
                    e2e=time.monotonic() - t0,
                    tpot=None,
                    text="",
                )
                return rec
            # chunk_size=None: yield each chunk as it arrives (a fixed size would wait to fill it).
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = str(obj["error"])[:300]
                    break
                for choice in obj.get("choices") or []:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - t0
                    parts.append((choice.get("delta") or {}).get("content") or "")
                    rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
                usage = obj.get("usage")
                if usage:
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    rec["completion_tokens"] = usage.get("completion_tokens") or 0
                    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                    ev = usage.get("kv_evict") or {}  # a turn that continued a stored history
                    rec["history_tokens"] = ev.get("history_tokens", 0)
                    rec["history_view_tokens"] = ev.get("history_view_tokens", 0)
                    rec["live_tokens"] = ev.get("live_tokens")
                    if kv_evict:
                        rec["kv_evict"] = usage.get("kv_evict")
    except (requests.RequestException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    if rec["error"] is None and rec["finish_reason"] == "abort":
        rec["error"] = "aborted by the server (finish_reason abort)"
    rec["e2e"] = time.monotonic() - t0
    n = rec["completion_tokens"]
    rec["tpot"] = (
        (rec["e2e"] - rec["ttft"]) / (n - 1) if rec["ttft"] is not None and n > 1 else None
    )
    rec["text"] = "".join(parts)
    return rec
