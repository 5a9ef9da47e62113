"""Seeded request traces: multi-turn agent sessions and ShareGPT-like length mixes.

A request is only lengths (the simulator never needs token ids): ``shared_len`` tokens of a
system prompt every request shares through the radix tree, then private prompt tokens, then
decoded tokens. Agent turns are sequential within a session; turn k re-sends the whole history::

    turn k prompt = | system (shared) | u1 t1 a1 | ... | u(k-1) t(k-1) a(k-1) | uk tk |
    turn k output = ak              u = user message, t = tool output, a = assistant turn
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Request:
    """One request of a trace. `session`/`turn` order agent turns; `rid` is unique in the trace."""

    rid: int
    session: int
    turn: int
    shared_len: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def _lognormal(
    g: torch.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    x = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * sigma) * median
    return x.round().clamp(lo, hi).to(torch.int64).tolist()


def agent_sessions(
    num_sessions: int = 8,
    turns: int = 4,
    seed: int = 0,
    system_len: int = 256,
    tool_median: float = 300,
    output_median: float = 150,
) -> list[Request]:
    """Agent sessions: a shared system prompt, user turns, tool outputs of varied length
    (lognormal, 32..1536 tokens) and assistant turns (lognormal, 16..512 tokens)."""
    g = torch.Generator().manual_seed(seed)
    reqs, rid = [], 0
    for s in range(num_sessions):
        users = _lognormal(g, turns, 40, 0.5, 8, 160)
        tools = _lognormal(g, turns, tool_median, 0.8, 32, 1536)
        outs = _lognormal(g, turns, output_median, 0.6, 16, 512)
        history = system_len
        for k in range(turns):
            prompt = history + users[k] + tools[k]
            reqs.append(Request(rid, s, k, system_len, prompt, outs[k]))
            history = prompt + outs[k]
            rid += 1
    return reqs


def sharegpt_like(
    num_requests: int = 48, seed: int = 0, prompt_median: float = 250, output_median: float = 200
) -> list[Request]:
    """Single-turn chat requests with ShareGPT-like lognormal lengths (prompt 16..2048,
    output 16..1024 tokens) and a short shared system prompt of 32 tokens."""
    g = torch.Generator().manual_seed(seed + 7919)
    prompts = _lognormal(g, num_requests, prompt_median, 0.9, 16, 2048)
    outs = _lognormal(g, num_requests, output_median, 0.8, 16, 1024)
    return [Request(i, i, 0, 32, 32 + p, o) for i, (p, o) in enumerate(zip(prompts, outs))]


WORKLOADS = {"agent": agent_sessions, "sharegpt": sharegpt_like}
