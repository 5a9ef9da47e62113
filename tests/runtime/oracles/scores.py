"""Per-token scores (higher = keep) of the policies that need no attention statistic, and the
reductions every policy shares."""

from __future__ import annotations

import hashlib
import math

import torch


def streaming_llm(positions: list[int]) -> list[float]:
    """Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
    arXiv:2309.17453: keep the attention sinks and the most recent tokens. With sinks protected
    by the keep rule, the score is the position: the newest tokens fill the budget."""
    return [float(p) for p in positions]


def _mix(x: int) -> int:
    """A 32-bit integer finalizer (two xorshift-multiply rounds with 0x45D9F3B, then xorshift)."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def request_id(rid: str) -> int:
    """The request's 32-bit identity: the little-endian 4-byte BLAKE2b digest of its id string."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=4).digest(), "little")


def seeded_uniform(position: int, seed: int, rid: int, step: int) -> float:
    """Uniform in [0, 1): the position mixed, then each of seed, request id and eviction step
    xored in (low 32 bits) and mixed again, over 2**32."""
    h = _mix(position & 0xFFFFFFFF)
    for key in (seed, rid, step):
        h = _mix(h ^ (key & 0xFFFFFFFF))
    return h / 2.0**32


def random_scores(positions: list[int], seed: int, rid: int, step: int) -> list[float]:
    """Random eviction (the baseline of the eviction papers): a uniformly random subset of the
    unprotected tokens, reproducible from (seed, request, eviction step, position)."""
    return [seeded_uniform(p, seed, rid, step) for p in positions]


def aggregate(stat: torch.Tensor, how: str) -> list[float]:
    """One float64 score per token of a ``[n, ...]`` per-layer, per-head statistic: the sum
    (ranks like the mean) or the largest over layers and heads (a token any head needs)."""
    flat = stat.reshape(stat.shape[0], -1).double()
    if how == "sum":
        return flat.sum(1).tolist()
    if how == "max":
        return flat.max(1).values.tolist() if flat.shape[1] else [0.0] * flat.shape[0]
    raise ValueError(f"aggregation {how!r}")


def pooled(scores: list[float], pool: int) -> list[float]:
    """SnapKV's pooling (Li et al., "SnapKV: LLM Knows What You are Looking for Before
    Generation", arXiv:2404.14469): each score becomes the mean of the scores of its row
    neighbours, ``pool // 2`` on each side where they exist (itself included)."""
    r, n = pool // 2, len(scores)
    return [
        math.fsum(scores[max(0, i - r) : i + r + 1]) / (min(n, i + r + 1) - max(0, i - r))
        for i in range(n)
    ]


def key_norm(keys: torch.Tensor, how: str) -> list[float]:
    """Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
    EMNLP 2024, arXiv:2406.11430: keys of low L2 norm draw attention, so keep them. Score:
    minus each ``[n, L, H, D]`` key's norm, aggregated over layers and heads."""
    return aggregate(-torch.linalg.vector_norm(keys.float(), dim=-1), how)
