"""What a stress run's traffic is made of: the kinds of request and their weights (`KINDS`),
the spec of the values a request's `kv_evict` may take (`TrafficSpec`, kept valid for the server
by the caller), the bad values `invalid` requests send (`INVALID`), and the seeded draws of
eviction settings and prompts that `stress_traffic.play` uses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = {  # kind -> weight
    "generate": 3,
    "generate_stream": 3,
    "chat": 2,
    "chat_stream": 2,
    "session": 2,
    "abort": 1,
    "disconnect": 1,
    "invalid": 1,
    "shortage": 1,
    "over_pool": 1,
}
# A `shortage` request is a session (for `copies`: a cached prompt sent again, `_cached_prompt_evicted`)
# whose request ids begin `<FORCED><page kind>-`: a server started
# with `forced_shortage.server_env(FORCED)` refuses it that kind of page (`forced_shortage.py`), so
# a stress run meets each shortage path on purpose next to the ones real pressure reaches.
FORCED = "shortage-"
SHARED_PREFIXES = 3  # a few common prompt heads, so prompts share radix-cache prefixes


@dataclass(frozen=True)
class TrafficSpec:
    policies: tuple = ("streamingllm", "random", "knorm", "h2o", "tova", "scissorhands")
    budgets: tuple = (48, 64, 128, 256)
    windows: tuple = (0, 16)
    sinks: tuple = (0, 4, 16)
    intervals: tuple = (1, 8, 16)  # each below a server prefill_chunk
    recalls: tuple = ()  # non-empty on a server with a host store: offload and recall vary too
    shortages: tuple = ()  # page kinds `shortage` requests are refused (none: no such requests)
    words_per_token: float = (
        0.5  # chat prompts: words of prose per token of the prompt lengths above
    )
    # `over_pool` requests: prompts of this many tokens (longer than the pool; empty: none sent),
    # answered where the server evicts during prefill (`prefill_chunk`), else HTTP 400.
    over_pool: tuple = ()
    over_pool_served: bool = False
    short_prompt: tuple = (8, 64)
    long_prompt: tuple = (300, 1500)
    short_new: tuple = (1, 48)
    long_new: tuple = (96, 384)
    vocab: tuple = (10, 2000)  # token ids of random prompts
    timeout: float = 300.0  # seconds per request


# One bad value of one field each (or an unknown field): HTTP 400 naming it.
INVALID = (
    {"policy": "streamingllm", "budget": 1},
    {"policy": "bogus"},
    {"policy": "random", "budget": "many"},
    {"policy": "h2o", "budget": -5},
    {"budget": 64.5},
    {"sink": -1},
    {"window": "wide"},
    {"interval": 0},
    {"offload": "yes"},
    {"recall": -3},
    {"budgets": 64},
    [64],
)
FIELD_SHARE = 0.6  # chance that an overriding request sets each optional field


def kinds(spec: TrafficSpec) -> dict[str, float]:
    """The kinds of request a run with `spec` sends, with their weights."""
    return {
        k: w
        for k, w in KINDS.items()
        if (k != "shortage" or spec.shortages) and (k != "over_pool" or spec.over_pool)
    }


def evict_choice(rng: random.Random, spec: TrafficSpec) -> dict | None:
    """None (the server's own setting), {"policy": "none"}, or a policy with each other field
    (budget, sink, window, interval; offload and recall where `spec.recalls`) set or left to the
    server's at random."""
    x = rng.random()
    if x < 0.2:
        return None
    if x < 0.35:
        return {"policy": "none"}
    kv = {"policy": rng.choice(spec.policies), "budget": rng.choice(spec.budgets)}
    for name, values in (
        ("sink", spec.sinks),
        ("window", spec.windows),
        ("interval", spec.intervals),
    ):
        if rng.random() < FIELD_SHARE:
            kv[name] = rng.choice(values)
    if spec.recalls and rng.random() < FIELD_SHARE:
        kv["offload"] = rng.random() < 0.8
        # recall needs offload: a request that turns offload off turns the server's recall off too
        kv["recall"] = rng.choice(spec.recalls) if kv["offload"] else 0
    return kv


def prompt_ids(rng: random.Random, spec: TrafficSpec, long: bool) -> list[int]:
    lo, hi = spec.long_prompt if long else spec.short_prompt
    n = rng.randint(lo, hi)
    head = []
    if rng.random() < 0.5:  # a shared head, seeded by its index only
        h = random.Random(f"prefix-{rng.randrange(SHARED_PREFIXES)}")
        head = [h.randrange(*spec.vocab) for _ in range(min(n, 256))]
    return head + [rng.randrange(*spec.vocab) for _ in range(n - len(head))]
