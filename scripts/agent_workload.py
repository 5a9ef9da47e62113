"""The synthetic agent workload of `bench_agent.py`: sessions of turns over a shared system
prompt and tool schema, with tool outputs and replies of seeded lognormal lengths, sized in
tokens by the served model's own tokenizer (`TokenFitter`); and the client that plays a session
against the server, one streaming chat completion per turn (`run_session`, `stream_chat`)."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import dataclass, field

import requests

WORDS = (
    "the request handler reads a config file from disk and returns a parsed value to the caller "
    "while the worker thread waits on a queue for the next batch of jobs each job has an id a "
    "status and a list of steps that must run in order if a step fails the job is retried with "
    "backoff until the limit is reached then marked as failed and logged the scheduler checks "
    "memory before it admits new work and frees pages when requests finish tests cover the parser "
    "the cache the network client and the command line interface build scripts compile the "
    "extension and copy artifacts into the output folder"
).split()
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_shell", "description": "Run a shell command in the sandbox and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer", "default": 60}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}}, "required": ["pattern"]}}},
]
SYSTEM_HEAD = ("You are a coding agent working in a software repository. Think step by step, call "
               "one tool per turn, read its output, and continue until the task is done. Tools:\n")


# ----------------------------------------------------------------------------- workload


@dataclass
class Session:
    index: int
    start: float                        # seconds after the run starts (Poisson arrivals)
    user: str                           # turn 1
    tools: list[str] = field(default_factory=list)   # turns 2..T


def lognormal_tokens(rng: random.Random, median: int, lo: int, hi: int, sigma: float = 0.6) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def prose(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def tool_text(rng: random.Random, n_words: int) -> str:
    """Looks like a tool's output: paths, line numbers and log words, one record per line."""
    out, words = [], 0
    while words < n_words:
        k = rng.randint(4, 10)
        out.append(f"src/pkg_{rng.randint(0, 40)}/mod_{rng.randint(0, 99)}.py:{rng.randint(1, 900)}: "
                   + prose(rng, k))
        words += k + 2
    return "\n".join(out)


class TokenFitter:
    """Cuts text to an exact token count with the server's /v1/tokenize and /v1/detokenize."""

    def __init__(self, base_url: str, model: str, timeout: float = 30.0):
        self.base_url, self.model, self.timeout = base_url, model, timeout
        self.exact = self._probe()

    def _post(self, path: str, payload: dict) -> dict:
        r = requests.post(self.base_url + path, json={"model": self.model, **payload}, timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def _probe(self) -> bool:
        try:
            return isinstance(self._post("/v1/tokenize", {"prompt": "probe"}).get("tokens"), list)
        except (requests.RequestException, ValueError):
            return False

    def tokenize(self, text: str) -> list[int]:
        return self._post("/v1/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def fit(self, texts: list[str], targets: list[int], keep: list[str]) -> list[str]:
        """Each text cut to its target token count, never shorter than its prefix `keep[i]`
        (texts must be long enough: about one word per token)."""
        if not self.exact:
            return [" ".join(t.split(" ")[: max(len(k.split(" ")), round(n / 1.3))])
                    for t, n, k in zip(texts, targets, keep)]
        kept = [i for i, k in enumerate(keep) if k]
        toks = self._post("/v1/tokenize", {"prompt": texts + [keep[i] for i in kept],
                                           "add_special_tokens": False})["tokens"]
        floors = [0] * len(texts)
        for i, ids in zip(kept, toks[len(texts):]):
            floors[i] = len(ids)
        cut = [ids[:max(n, floor)] for ids, n, floor in zip(toks, targets, floors)]
        return self._post("/v1/detokenize", {"tokens": cut, "skip_special_tokens": True})["text"]


def build_workload(args, fitter: TokenFitter) -> tuple[str, list[Session]]:
    # Separate streams: the texts do not depend on the arrival rate.
    arrivals = random.Random(f"{args.seed}-arrivals")
    # The instructions and the whole tool schema stay even if they exceed `--system-tokens`.
    system_head = SYSTEM_HEAD + json.dumps(TOOLS, separators=(",", ":")) + "\nRules: "
    sessions, t = [], 0.0
    for i in range(args.sessions):
        if i and not math.isinf(args.rate):
            t += arrivals.expovariate(args.rate)
        srng = random.Random(f"{args.seed}-session-{i}")
        n_user = lognormal_tokens(srng, args.user_tokens, 4, 4 * args.user_tokens)
        n_tools = [lognormal_tokens(srng, args.tool_tokens, args.tool_min, args.tool_max)
                   for _ in range(args.turns - 1)]
        user = ("Task: " + prose(srng, 2 * n_user), n_user)
        tools = [(tool_text(srng, 2 * n), n) for n in n_tools]
        sessions.append((i, t, user, tools))
    # One batch of tokenize/detokenize calls for every text of the run.
    texts = [system_head + prose(random.Random(f"{args.seed}-system"), 2 * args.system_tokens)]
    targets = [args.system_tokens]
    for _, _, user, tools in sessions:
        for text, n in (user, *tools):
            texts.append(text)
            targets.append(n)
    fitted = fitter.fit(texts, targets, [system_head] + [""] * (len(texts) - 1))
    system, pos, out = fitted[0], 1, []
    args.system_tokens_actual = len(fitter.tokenize(system)) if fitter.exact else None
    for i, start, _, tools in sessions:
        out.append(Session(i, start, fitted[pos], fitted[pos + 1: pos + 1 + len(tools)]))
        pos += 1 + len(tools)
    return system, out


# ----------------------------------------------------------------------------- session client


def stream_chat(http: requests.Session, args, messages: list[dict]) -> dict:
    """One streaming chat completion; returns the timings, usage and reply text."""
    payload = {"model": args.model, "messages": messages, "max_tokens": args.reply_tokens,
               "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if args.kv_evict_json is not None:
        payload["custom_params"] = {"kv_evict": args.kv_evict_json}
    rec = {"ttft": None, "e2e": None, "prompt_tokens": None, "completion_tokens": 0, "cached_tokens": None,
           "error": None}
    parts: list[str] = []
    t0 = time.monotonic()
    rec["t_start"] = t0
    try:
        with http.post(args.base_url + "/v1/chat/completions", json=payload, stream=True,
                       timeout=(10, args.request_timeout)) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {r.text[:300]}"
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
                    delta = choice.get("delta") or {}
                    parts.append(delta.get("content") or "")
                usage = obj.get("usage")
                if usage:
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    rec["completion_tokens"] = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = details.get("cached_tokens")
    except (requests.RequestException, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["e2e"] = time.monotonic() - t0
    n = rec["completion_tokens"]
    rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (n - 1) if rec["ttft"] is not None and n > 1 else None
    rec["text"] = "".join(parts)
    return rec


def run_session(sess: Session, system: str, args, t0: float, on_done, slots: threading.Semaphore | None) -> list[dict]:
    """Wait for the session's start, then play its turns (holding one of `slots`, if given)."""
    delay = t0 + sess.start - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    if slots is None:
        return _session_turns(sess, system, args, t0, on_done)
    with slots:
        return _session_turns(sess, system, args, t0, on_done)


def _session_turns(sess: Session, system: str, args, t0: float, on_done) -> list[dict]:
    """Every turn of one session, each request record passed to `on_done`; stops at an error."""
    http = requests.Session()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": sess.user}]
    out = []
    for turn in range(1, args.turns + 1):
        if turn > 1:
            if args.think_time > 0:
                time.sleep(args.think_time)
            content = sess.tools[turn - 2]
            if args.tool_role == "user":
                content = "Tool output:\n" + content
            messages.append({"role": args.tool_role, "content": content})
        rec = stream_chat(http, args, messages)
        text = rec.pop("text")
        rec.update(kind="request", session=sess.index, turn=turn,
                   t_start=round(rec["t_start"] - t0, 4), t_end=round(time.monotonic() - t0, 4))
        out.append(rec)
        on_done(rec)
        if rec["error"] is not None:
            break  # the session cannot continue without the reply
        messages.append({"role": "assistant", "content": text})
    return out
