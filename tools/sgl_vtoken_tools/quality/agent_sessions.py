"""Seeded agent sessions whose last turn asks for a fact stated early, in the splits of
`splits.py`.

    system     SYSTEM: instructions and the JSON tool definitions (TOOLS); the same text for
               every session, split and seed
    turn 1     the user's task (the split's TASKS); a session with ``fact_turn`` 1 states the
               fact at the end of it
    turns 2..T-1  tool outputs (role "tool"), the kinds in turn (KINDS: a shell log, code search
               results, a file listing, JSON records), each `tool_tokens` tokens (uniform in
               [lo, hi]) of lines built from the split's sentences; a session with
               ``fact_turn`` 2 has the fact as one line of the first, at a depth of the split
    turn T     the fact's question (T uniform in `turns`)

Session `i` states its fact in turn ``1 + i % 2`` with phrasing ``i // 2`` (cyclic) of the
split and depth ``i`` (cyclic): the split's 5-digit key sentence and question
(`splits.PHRASINGS`), so a setting chosen on the tuning split is quoted on the held-out split.
The key is the only 5-digit number of the session (essay sentences with one are skipped,
generated numbers have at most 4 digits). Session `i` of (split, seed) is the same whatever
`num` is; the model's replies come between the turns (`tools/sgl_vtoken_tools/bench/agent_chat.py`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from sgl_vtoken_tools.quality.splits import DEPTHS, PHRASINGS, _check, split_sentences

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": text,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string"} for arg in args},
                "required": list(args[:1]),
            },
        },
    }
    for name, text, args in (
        ("run_shell", "Run a shell command in the sandbox; returns its log.", ("command", "cwd")),
        ("search_code", "Search the repository for a regular expression.", ("pattern", "glob")),
        ("list_files", "List a folder of the repository with sizes and dates.", ("path",)),
        ("query_records", "Query the job database; returns JSON records.", ("table", "where")),
    )
]
SYSTEM = (
    "You are an agent working in a software repository. Call one tool per turn, read its "
    "output, and keep the facts the user gives you. Tools:\n"
    + json.dumps(TOOLS, separators=(",", ":"))
)
KINDS = ("log", "search", "listing", "records")
TOOL_OF = {"log": "run_shell", "search": "search_code", "listing": "list_files"}
TASKS = {
    "tuning": (
        "The nightly build of the data service fails. Find the failing step and fix it.",
        "Tests of the parser are flaky. Find out which test fails and why.",
        "The cache uses too much memory. Find what holds it and report back.",
    ),
    "heldout": (
        "A customer reports that exports stop halfway. Find the cause in the logs.",
        "The deploy script hangs on the staging host. Find the step that waits.",
        "Search results come back in the wrong order. Find the code that sorts them.",
    ),
    "final": (
        "Uploads to the archive fail after a few minutes. Find the step that times out.",
        "Last night's reports are missing rows. Find where the rows are dropped.",
        "The login page is slow for some users. Find the query that takes long.",
    ),
}
LEVELS = ("INFO", "INFO", "DEBUG", "WARN", "ERROR")
STATUS = ("ok", "queued", "running", "failed", "done")
FIVE_DIGITS = re.compile(r"\d{5}")


@dataclass(frozen=True)
class AgentSession:
    """One session: `turns` = (role, content) of turns 1..T (roles "user" and "tool"), the
    expected `answer` (the key), ``meta``: split, seed, fact_turn, depth, phrasing, kinds,
    tool_tokens (each tool output's length in tokens)."""

    id: str
    turns: tuple[tuple[str, str], ...]
    answer: str
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class AgentSpec:
    """`num` sessions of the split; `turns` and `tool_tokens` are inclusive (lo, hi) ranges."""

    split: str = "heldout"
    num: int = 8
    turns: tuple[int, int] = (8, 10)
    tool_tokens: tuple[int, int] = (200, 600)
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.split)
        (t0, t1), (n0, n1) = self.turns, self.tool_tokens
        if self.num < 1:
            raise ValueError(f"AgentSpec.num must be >= 1 (got {self.num})")
        if not 3 <= t0 <= t1:
            raise ValueError(f"AgentSpec.turns: need 3 <= lo <= hi (got {self.turns})")
        if not 40 <= n0 <= n1:
            raise ValueError(f"AgentSpec.tool_tokens: need 40 <= lo <= hi (got {self.tool_tokens})")


def _words(rng: random.Random, sents: list[str], most: int) -> list[str]:
    """The words of a random essay sentence without a 5-digit number, at most `most`."""
    while True:
        s = rng.choice(sents)
        if not FIVE_DIGITS.search(s):
            return s.split()[:most]


def _line(kind: str, rng: random.Random, words: list[str]) -> str:
    """One line of a tool output of `kind` carrying `words`; its numbers have at most 4 digits."""
    text = " ".join(words)
    if kind == "log":
        return (
            f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {rng.choice(LEVELS):<5} "
            f"worker.{rng.randint(1, 9)}: {text}"
        )
    if kind == "search":
        name = "_".join(w.strip(".,;:!?'\"()").lower() for w in words[:2]) or "notes"
        return f"src/{name}.py:{rng.randint(1, 999)}: {text}"
    if kind == "listing":
        name = "_".join(w.strip(".,;:!?'\"()").lower() for w in words[:3]) or "notes"
        return (
            f"-rw-r--r-- 1 dev dev {rng.randint(10, 9999):>5} Mar {rng.randint(1, 28):2d} "
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {name}.txt  # {text}"
        )
    record = {"id": rng.randint(1, 9999), "status": rng.choice(STATUS), "note": text}
    return json.dumps(record)


def tool_output(
    tok, kind: str, rng: random.Random, sents: list[str], target: int, hi: int, fact=None, depth=0.0
) -> str:
    """Lines of `kind` until the text holds `target` tokens, at most `hi`: the last filler line
    loses words until it fits, or goes (so the text holds more than `hi` minus a line's tokens);
    `fact`, when given, is one whole line at `depth` of the lines."""
    fact_line = None if fact is None else _line(kind, random.Random(rng.random()), fact.split())

    def text(lines: list[str]) -> str:
        at = round(depth * len(lines))
        return "\n".join(lines[:at] + [fact_line] + lines[at:] if fact_line else lines)

    def count(lines: list[str]) -> int:
        return len(tok(text(lines), add_special_tokens=False)["input_ids"])

    lines: list[str] = []
    while not lines or count(lines) < target:
        seed, words = rng.random(), _words(rng, sents, 30)
        lines.append(_line(kind, random.Random(seed), words))
    while count(lines) > hi and len(words) > 1:
        words = words[:-1]
        lines[-1] = _line(kind, random.Random(seed), words)
    if count(lines) > hi and len(lines) > 1:
        lines.pop()
    return text(lines)


def agent_sessions(tok, spec: AgentSpec, wheel_dir=None) -> list[AgentSession]:
    """The spec's sessions, their tool outputs measured in `tok`'s tokens."""
    sents = split_sentences(spec.split, wheel_dir)
    phrasings, depths = PHRASINGS[spec.split], DEPTHS[spec.split]
    out = []
    for i in range(spec.num):
        rng = random.Random(f"{spec.split}/agent/{spec.seed}/{i}")
        fact_turn = 1 + i % 2
        ph = phrasings[(i // 2) % len(phrasings)]
        depth = depths[i % len(depths)]
        key = str(rng.randrange(10000, 100000))
        fact = ph.fact.format(key=key)
        n_turns = rng.randint(*spec.turns)
        task = rng.choice(TASKS[spec.split])
        turns = [("user", f"{task} {fact}" if fact_turn == 1 else task)]
        kinds, lengths = [], []
        for t in range(2, n_turns):
            kind = KINDS[(i + t) % len(KINDS)]
            target = rng.randint(*spec.tool_tokens)
            here = fact if fact_turn == 2 and t == 2 else None
            body = tool_output(tok, kind, rng, sents, target, spec.tool_tokens[1], here, depth)
            kinds.append(kind)
            lengths.append(len(tok(body, add_special_tokens=False)["input_ids"]))
            name = TOOL_OF.get(kind, "query_records")
            turns.append(("tool", f"Output of {name}:\n{body}"))
        turns.append(("user", ph.question))
        meta = {
            "split": spec.split,
            "seed": spec.seed,
            "fact_turn": fact_turn,
            "depth": None if fact_turn == 1 else depth,
            "phrasing": ph.name,
            "kinds": kinds,
            "tool_tokens": lengths,
        }
        out.append(AgentSession(f"agent-{spec.split}-{spec.seed}-{i}", tuple(turns), key, meta))
    return out
