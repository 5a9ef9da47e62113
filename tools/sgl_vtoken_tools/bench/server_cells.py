"""Server flags of the benchmark cells the joint and agent benchmarks share: one name, one
command line (None: stock SGLang without the plugin). The README's rows quote these commands."""

from __future__ import annotations

import json
import shlex

CHUNK = {"prefill_chunk": 64}
RECALL = {**CHUNK, "offload": True, "host_tokens": 1 << 18, "recall": 64}
# Host histories: a stored history the radix cache evicts for room moves to host memory, and the
# next turn of its conversation continues it from there instead of prefilling it again.
HOST = {"host_tokens": 1 << 20, "offload": True}
# Every evicting cell evicts at most every 16 decode steps (README, "where to start"); h2o's
# defaults are the options chosen on the tuning split (docs/RESULTS.md, "Defaults that keep
# answers"). With eviction during prefill h2o keeps a recent window of 32: without one the
# tuning split's documents come back as "TheTheThe..." (tokens no query has attended yet score
# lowest: the question and the tokens just decoded).
EVERY_16 = ["--kv-evict-interval", "16"]
H2O_256 = ["--kv-evict", "h2o", "--kv-budget", "256", *EVERY_16]
H2O_CHUNK = ["--kv-evict", "h2o", "--kv-budget", "256", "--kv-window", "32", *EVERY_16]
CELLS = {
    "stock": None,
    "full": ["--kv-evict", "none"],
    "h2o b256": H2O_256,
    "h2o b128": ["--kv-evict", "h2o", "--kv-budget", "128", *EVERY_16],
    "streamingllm b256 chunk 64": [
        "--kv-evict",
        "streamingllm",
        "--kv-budget",
        "256",
        *EVERY_16,
        "--kv-evict-config",
        json.dumps(CHUNK),
    ],
    "h2o b256 chunk 64": [*H2O_CHUNK, "--kv-evict-config", json.dumps(CHUNK)],
    # eviction during prefill with recall: the document's last chunk brings back 64 of its victims
    "h2o b256 chunk 64 + recall 64": [*H2O_CHUNK, "--kv-evict-config", json.dumps(RECALL)],
    # h2o b256 with host histories, then with recall as well
    "h2o b256 + host": [*H2O_256, "--kv-evict-config", json.dumps(HOST)],
    "h2o b256 + host + recall 192": [
        *H2O_256,
        "--kv-evict-config",
        json.dumps({**HOST, "recall": 192}),
    ],
    # the chat command of the budget trigger (the README's until the pressure trigger): the same
    # with 16 sinks and a recent window of 32, the setting the chat conversations measure
    # (`sgl_vtoken_tools.quality.chat_server`)
    "h2o b256 s16 w32 + host + recall 192": [
        *H2O_256,
        "--kv-sink",
        "16",
        "--kv-window",
        "32",
        "--kv-evict-config",
        json.dumps({**HOST, "recall": 192}),
    ],
}
# The chat command of the budget trigger: every row at its budget whether or not the pool is
# short (the README's chat command until 2026-12-06; `pressure` below is the README's now).
CHAT = "h2o b256 s16 w32 + host + recall 192"
# The chat command under the pressure trigger: a row keeps every token while the pool has room
# and is compacted, no further than the shortage needs and never below its budget, only when the
# pool runs short (docs/design/step.md, "Eviction under memory pressure").
# With `prefill_chunk` a prompt that could never fit the pool whole is evicted during its
# prefill (a conversation longer than the pool is served); one that fits is prefilled whole.
CELLS["pressure"] = [
    *CELLS[CHAT][:-1],
    json.dumps({**HOST, "recall": 192, "prefill_chunk": 64}),
    "--kv-evict-trigger",
    "pressure",
]


def cell_flags(
    spec: str, cells: dict[str, list[str] | None] = CELLS
) -> tuple[str, list[str] | None]:
    """A `--cells` entry of a launched server: a name of `cells`, or ``name=flags`` (shell
    words). Returns ``(name, flags)``; an unknown name is a ValueError naming the choices."""
    name, eq, flags = spec.partition("=")
    if eq:
        return name, shlex.split(flags)
    if spec not in cells:
        raise ValueError(f"unknown cell {spec!r}; choose from {list(cells)} or write name=flags")
    return spec, cells[spec]
