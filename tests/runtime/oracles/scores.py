"""Per-token scores (higher = keep) of the policies that need no attention statistic, and the
reductions every policy shares."""

from __future__ import annotations

import hashlib
import json
import math
import struct

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


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata of a safetensors file: an 8-byte little-endian header length, the
    JSON header (name -> dtype, shape, byte offsets; ``__metadata__``), then the data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}
    tensors = {}
    for name, t in header.items():
        lo, hi = t["data_offsets"]
        raw = torch.frombuffer(bytearray(data[lo:hi]), dtype=dtypes[t["dtype"]])
        tensors[name] = raw.reshape(t["shape"])
    return tensors, meta


class KVPScorer:
    """Moschella, Manduchi, Sener, "Learning to Evict from Key-Value Cache", arXiv:2602.10238:
    one MLP per (layer, KV head) scores each cached token from its key, its value, its age
    ``log1p(t - pos)`` and ``pos / (t + 1)`` (t: the newest position), features standardized;
    each head's scores become a distribution over the row (softmax: the Plackett-Luce
    probability of being ranked first), aggregated over layers and heads. Weights: the
    checkpoint (``w1 [G, F, K]``, ``b1 [G, K]``, ``w2 [G, K]``, ``b2 [G]``, ``feat_mean``,
    ``feat_std [G, F]``, G = layers x KV heads in that order)."""

    def __init__(self, path: str) -> None:
        self.t, _ = read_safetensors(path)

    def scores(
        self, keys: torch.Tensor, values: torch.Tensor, positions: list[int], how: str
    ) -> list[float]:
        n, layers, heads, _ = keys.shape
        pos = torch.tensor(positions, dtype=torch.float32)
        newest = pos.max()
        age = torch.log1p((newest - pos).clamp_min(0.0))
        rel = pos / (newest + 1.0)
        k = keys.float().reshape(n, layers * heads, -1)
        v = values.float().reshape(n, layers * heads, -1)
        x = torch.cat([k, v, torch.stack([age, rel], -1)[:, None].expand(-1, k.shape[1], 2)], -1)
        x = (x - self.t["feat_mean"]) / self.t["feat_std"]  # [n, G, F]
        hidden = torch.relu(torch.einsum("ngf,gfk->ngk", x, self.t["w1"]) + self.t["b1"])
        s = (hidden * self.t["w2"]).sum(-1) + self.t["b2"]  # [n, G]
        return aggregate(torch.softmax(s.double(), dim=0), how)
