"""Concurrent multi-turn chat clients against one running server (OpenAI `/v1/chat/completions`).

    python -m sgl_vtoken_tools chat-clients --base-url http://127.0.0.1:30000 --clients 10 --duration 300

Each of `--clients` threads holds a conversation and re-sends its whole history every turn: a
user message of 10-400 words of essay-like English (a fixed word list, seeded per client),
`max_tokens` 16-128, the reply appended to the history. A quarter of the requests stream, and a
third of those are closed after a few chunks (the partial reply joins the history). About 10%
carry a per-request `custom_params.kv_evict` override (`--override-rate`), about 3% are invalid
(a bad `kv_evict`, an empty message list, a negative `max_tokens`; expected HTTP 400). A
conversation the server refuses as too long (HTTP 400) starts over.

JSON lines on stdout: `request` (client, turn, kind, status, latency, prompt/completion tokens),
`progress` every `--progress-every` s (requests done and in flight, and from `/get_server_info`'s
`internal_states[0]["vtoken"]`: pool total/available/evictable tokens, running evicting
requests), then `stuck` (no request completed for `--stuck-after` s: exit status 2, the server
left as it is, for `py-spy dump`), `server_gone` (three progress queries failed: exit status 3)
or `summary` (exit status 0).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter

import requests

from sgl_vtoken_tools.cli import common

WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one "
    "had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find use "
    "may water long little very after words called just where most know get through back much go "
    "good new write our me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between "
    "name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let "
    "night following picture being study second eyes soon times story boys since white days ever "
    "paper hard near sentence better best across during today others sure means knew why try told "
    "young miles sun ways thing whole hear example heard several change answer room sea against "
    "top turned learn point city play toward five using himself usually history argument evidence "
    "however therefore although essay author reader question chapter society economy science theory "
    "language culture government century nature knowledge experience memory morning river mountain"
).split()

OVERRIDES = (  # valid per-request settings (server page size 16: budgets in whole pages)
    {"policy": "none"},
    {"policy": "streamingllm", "budget": 256},
    {"policy": "streamingllm", "budget": 64},
    {"policy": "random", "budget": 192, "window": 16},
    {"budget": 96},
)
INVALID = (  # expected HTTP 400
    ("kv_evict", {"policy": "bogus"}),
    ("kv_evict", {"budget": 64.5}),
    ("kv_evict", {"budget": 1 << 20}),
    ("messages", []),
    ("max_tokens", -5),
)


def prose(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    out, i = [], 0
    while i < len(words):  # sentences of 6-20 words
        k = rng.randint(6, 20)
        s = " ".join(words[i : i + k])
        out.append(s[:1].upper() + s[1:] + ".")
        i += k
    return " ".join(out)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.done = 0
        self.in_flight = 0
        self.last_done = time.monotonic()
        self.outcomes = Counter()

    def start(self):
        with self.lock:
            self.in_flight += 1

    def finish(self, outcome: str):
        with self.lock:
            self.in_flight -= 1
            self.done += 1
            self.outcomes[outcome] += 1
            self.last_done = time.monotonic()


_EMIT = threading.Lock()


def emit(obj: dict) -> None:
    with _EMIT:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def one_request(base: str, body: dict, stream: bool, close_after: int | None, timeout: float):
    """Returns (status, reply_text, usage, note)."""
    url = base + "/v1/chat/completions"
    if not stream:
        r = requests.post(url, json=body, timeout=timeout)
        if r.status_code != 200:
            return r.status_code, "", None, r.text[:200]
        data = r.json()
        return 200, data["choices"][0]["message"]["content"] or "", data.get("usage"), ""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, chunks = [], None, 0
    with requests.post(url, json=body, timeout=timeout, stream=True) as r:
        if r.status_code != 200:
            return r.status_code, "", None, r.text[:200]
        for line in r.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            data = json.loads(payload)
            if data.get("usage"):
                usage = data["usage"]
            for ch in data.get("choices") or []:
                text.append((ch.get("delta") or {}).get("content") or "")
            chunks += 1
            if close_after is not None and chunks >= close_after:
                return 200, "".join(text), None, "closed_early"
    return 200, "".join(text), usage, ""


def client_loop(cid: int, args, stats: Stats, stop: threading.Event) -> None:
    rng = random.Random(args.seed * 1000 + cid)
    history: list[dict] = []
    conv, turn = 0, 0
    while not stop.is_set():
        if not history:
            history = [
                {"role": "system", "content": f"You are assistant number {cid}. " + prose(rng, 20)}
            ]
            conv, turn = conv + 1, 0
        user = {"role": "user", "content": prose(rng, rng.randint(10, 400))}
        messages = history + [user]
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": rng.randint(16, 128),
            "temperature": rng.choice((0.0, 0.7, 1.0)),
        }
        kind = "plain"
        r = rng.random()
        if r < args.invalid_rate:
            field, value = rng.choice(INVALID)
            kind = f"invalid:{field}"
            if field == "kv_evict":
                body["custom_params"] = {"kv_evict": value}
            else:
                body[field] = value
        elif r < args.invalid_rate + args.override_rate:
            ov = rng.choice(OVERRIDES)
            body["custom_params"] = {"kv_evict": ov}
            kind = "override:" + json.dumps(ov, sort_keys=True)
        stream = rng.random() < args.stream_rate
        close_after = rng.randint(1, 6) if stream and rng.random() < 1 / 3 else None
        t0 = time.monotonic()
        stats.start()
        try:
            status, reply, usage, note = one_request(
                args.base_url, body, stream, close_after, args.timeout
            )
        except Exception as e:  # noqa: BLE001 (a timeout or a dropped connection is an outcome)
            status, reply, usage, note = -1, "", None, f"{type(e).__name__}: {e}"[:200]
        lat = time.monotonic() - t0
        outcome = "ok" if status == 200 else f"http_{status}"
        if note == "closed_early":
            outcome = "closed_early"
        stats.finish(outcome if not kind.startswith("invalid") else f"{kind}->{outcome}")
        emit(
            {
                "type": "request",
                "client": cid,
                "conv": conv,
                "turn": turn,
                "kind": kind,
                "stream": stream,
                "status": status,
                "outcome": outcome,
                "latency_s": round(lat, 3),
                "messages": len(messages),
                "prompt_tokens": (usage or {}).get("prompt_tokens"),
                "completion_tokens": (usage or {}).get("completion_tokens"),
                "cached_tokens": ((usage or {}).get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ),
                "history_tokens": (((usage or {}).get("kv_evict") or {}).get("history_tokens")),
                **({"note": note} if note and note != "closed_early" else {}),
            }
        )
        if kind.startswith("invalid"):
            continue  # the conversation goes on without it
        if status == 200:
            history = messages + [{"role": "assistant", "content": reply}]
            turn += 1
        elif status == 400:  # too long for the server: start over
            history = []
        else:
            time.sleep(1.0)


def server_figures(base: str) -> dict:
    try:
        info = requests.get(base + "/get_server_info", timeout=10).json()
        st = info["internal_states"][0]
        vt = st.get("vtoken", {})
        return {
            k: vt.get(k)
            for k in (
                "pool_total_tokens",
                "pool_available_tokens",
                "pool_evictable_tokens",
                "running_evicting_requests",
                "evictions",
                "history_hits",
            )
        }
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def main(argv=None) -> int:
    p = common.parser(__doc__, __name__)
    p.add_argument("--base-url", required=True)
    common.numbers(
        p,
        clients=10,
        duration=300.0,
        seed=0,
        stream_rate=0.25,
        override_rate=0.10,
        invalid_rate=0.03,
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per request")
    common.numbers(p, progress_every=5.0, stuck_after=60.0)
    args = p.parse_args(argv)
    args.base_url = args.base_url.rstrip("/")

    stats, stop = Stats(), threading.Event()
    threads = [
        threading.Thread(target=client_loop, args=(i, args, stats, stop), daemon=True)
        for i in range(args.clients)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    stuck, errors = False, 0
    while True:
        time.sleep(args.progress_every)
        now = time.monotonic()
        with stats.lock:
            done, fl, idle = stats.done, stats.in_flight, now - stats.last_done
        figures = server_figures(args.base_url)
        emit(
            {
                "type": "progress",
                "t": round(now - t0, 1),
                "done": done,
                "in_flight": fl,
                "since_last_done_s": round(idle, 1),
                **figures,
            }
        )
        errors = errors + 1 if "error" in figures else 0
        if errors >= 3:  # the server is gone
            emit({"type": "server_gone", "t": round(now - t0, 1), "done": done})
            os._exit(3)
        if idle > args.stuck_after and fl > 0:
            stuck = True
            break
        if now - t0 > args.duration:
            break
    stop.set()
    with stats.lock:
        summary = {
            "t": round(time.monotonic() - t0, 1),
            "done": stats.done,
            "in_flight": stats.in_flight,
            "outcomes": dict(stats.outcomes),
        }
    emit({"type": "stuck" if stuck else "summary", **summary, **server_figures(args.base_url)})
    if not stuck:
        for t in threads:
            t.join(timeout=args.timeout)
    sys.stdout.flush()
    if stuck:  # client threads still block on the server: leave without waiting for them
        os._exit(2)
    return 0
