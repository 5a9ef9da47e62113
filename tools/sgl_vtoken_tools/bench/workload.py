"""The synthetic multi-turn agent workload: sessions of turns over a shared system prompt (with a
JSON tool schema), seeded lognormal lengths of user tasks and tool outputs, Poisson arrivals.

Same `WorkloadSpec`, same texts and arrival times, whatever the server (given the same
tokenizer): texts come from per-session random streams seeded by (seed, session index), so a
run with fewer sessions plays a prefix of the same sessions, and arrivals come from their own
stream, so the texts do not depend on the rate.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

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
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {
                        "type": "string",
                        "description": "path relative to the repository root",
                    },
                    "start_line": {"type": "integer"},
                    "end_line": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the sandbox and return its output.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout_s": {"type": "integer", "default": 60},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    },
]


def at_least_one(spec: object, *names: str) -> None:
    """ValueError naming the first field of `names` of the dataclass `spec` that is < 1."""
    for name in names:
        if getattr(spec, name) < 1:
            raise ValueError(
                f"{type(spec).__name__}.{name} must be >= 1 (got {getattr(spec, name)})"
            )


SYSTEM_HEAD = (
    "You are a coding agent working in a software repository. Think step by step, call "
    "one tool per turn, read its output, and continue until the task is done. Tools:\n"
)


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes in tokens of the served model's tokenizer; `rate` in sessions per second (inf: all
    sessions at t = 0)."""

    sessions: int = 8
    turns: int = 4
    rate: float = math.inf
    seed: int = 0
    system_tokens: int = 256  # shared system prompt incl. the tool schema (kept whole if longer)
    user_tokens: int = 40  # median user task (turn 1)
    tool_tokens: int = 300  # median tool output (turns 2..)
    tool_min: int = 32
    tool_max: int = 1024

    def __post_init__(self):
        at_least_one(
            self, "sessions", "turns", "system_tokens", "user_tokens", "tool_tokens", "tool_min"
        )
        if self.tool_max < self.tool_min:
            raise ValueError(
                f"tool_max must be >= tool_min (got {self.tool_max} < {self.tool_min})"
            )
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 or inf (got {self.rate})")


@dataclass
class Session:
    index: int
    start: float  # seconds after the run starts (Poisson arrivals)
    user: str  # turn 1
    tools: list[str] = field(default_factory=list)  # turns 2..T


@dataclass
class Workload:
    system: str
    system_tokens: int | None  # its real length (None when lengths are approximate)
    sessions: list[Session]


def lognormal_tokens(rng: random.Random, median: int, lo: int, hi: int, sigma: float = 0.6) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def prose(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def tool_text(rng: random.Random, n_words: int) -> str:
    """Looks like a tool's output: paths, line numbers and log words, one record per line."""
    out, words = [], 0
    while words < n_words:
        k = rng.randint(4, 10)
        out.append(
            f"src/pkg_{rng.randint(0, 40)}/mod_{rng.randint(0, 99)}.py:{rng.randint(1, 900)}: "
            + prose(rng, k)
        )
        words += k + 2
    return "\n".join(out)


def build_workload(spec: WorkloadSpec, fitter) -> Workload:
    """The run's texts, cut to their token targets by `fitter` (`tokenizer.TokenFitter`: one batch
    of tokenize/detokenize calls for every text), and the sessions' arrival times."""
    arrivals = random.Random(f"{spec.seed}-arrivals")
    # The instructions and the whole tool schema stay even if they exceed `system_tokens`.
    system_head = SYSTEM_HEAD + json.dumps(TOOLS, separators=(",", ":")) + "\nRules: "
    drafts, t = [], 0.0
    for i in range(spec.sessions):
        if i and not math.isinf(spec.rate):
            t += arrivals.expovariate(spec.rate)
        srng = random.Random(f"{spec.seed}-session-{i}")
        n_user = lognormal_tokens(srng, spec.user_tokens, 4, 4 * spec.user_tokens)
        n_tools = [
            lognormal_tokens(srng, spec.tool_tokens, spec.tool_min, spec.tool_max)
            for _ in range(spec.turns - 1)
        ]
        user = ("Task: " + prose(srng, 2 * n_user), n_user)
        drafts.append((i, t, user, [(tool_text(srng, 2 * n), n) for n in n_tools]))
    texts = [system_head + prose(random.Random(f"{spec.seed}-system"), 2 * spec.system_tokens)]
    targets = [spec.system_tokens]
    for _, _, user, tools in drafts:
        for text, n in (user, *tools):
            texts.append(text)
            targets.append(n)
    fitted = fitter.fit(texts, targets, [system_head] + [""] * (len(texts) - 1))
    sessions, pos = [], 1
    for i, start, _, tools in drafts:
        sessions.append(Session(i, start, fitted[pos], fitted[pos + 1 : pos + 1 + len(tools)]))
        pos += 1 + len(tools)
    system_tokens = len(fitter.tokenize(fitted[0])) if fitter.exact else None
    return Workload(fitted[0], system_tokens, sessions)
