"""The synthetic agent workload of `bench_agent.py`: sessions of turns over a shared system
prompt and tool schema, with tool outputs and replies of seeded lognormal lengths, sized in
tokens by the served model's own tokenizer (`TokenFitter`)."""

from __future__ import annotations

import json
import math
import random
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


# ----------------------------------------------------------------------------- server probes
