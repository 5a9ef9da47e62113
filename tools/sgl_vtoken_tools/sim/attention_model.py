"""A seeded synthetic heavy-hitter attention model: the statistics attention policies read.

No model runs in the simulator; attention probabilities come from a closed form with the three
effects the policies are built around (H2O's heavy hitters, StreamingLLM's sinks, recency)::

    logit(query t -> key j, layer l, head h) = a[j,l,h] - gamma * log(1 + t - p_j) + sigma_q * u[t,l,h] * c[j,l,h]
    a[j,l,h] = beta * heavy[j] + sink_boost * (p_j < 4) + sigma_a * N(0,1)
    heavy[j] ~ Bernoulli(heavy_frac), the same token for every layer and head (persistent)
    probs = softmax over the keys the query sees (the live row plus earlier tokens of its block)

`u` (query) and `c` (key) are N(0,1) tables: a per-query, per-head component, so TOVA (last
query) and H2O (all queries) disagree. Keys for key-norm scoring point in random directions
with ``||k|| = exp(-kappa * a + 0.1 * N(0,1))``: important tokens have smaller keys, the
correlation KNorm relies on. Everything is drawn once per request from (seed, rid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionParams:
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    heavy_frac: float = 0.08
    beta: float = 3.0
    sink_boost: float = 4.0
    sigma_a: float = 0.7
    gamma: float = 1.0
    sigma_q: float = 1.0
    kappa: float = 0.3


class SyntheticAttention:
    """Per-request tables for positions ``[0, total_len)``."""

    def __init__(
        self, total_len: int, rid: int, seed: int, params: AttentionParams = AttentionParams()
    ):
        p, self.params = params, params
        g = torch.Generator().manual_seed((seed * 1_000_003 + rid) % 2**63)
        shape = (total_len, p.layers, p.heads)
        heavy = (torch.rand(total_len, generator=g) < p.heavy_frac).float()
        sink = (torch.arange(total_len) < 4).float()
        self.a = (p.beta * heavy + p.sink_boost * sink).view(-1, 1, 1) + p.sigma_a * torch.randn(
            shape, generator=g
        )
        self.u = torch.randn(shape, generator=g)
        self.c = torch.randn(shape, generator=g)
        direction = torch.randn(*shape, p.head_dim, generator=g)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        norm = torch.exp(-p.kappa * self.a + 0.1 * torch.randn(shape, generator=g))
        self.keys = direction * norm.unsqueeze(-1)  # [T, L, H, D]

    def block_probs(
        self, row_pos: torch.Tensor, new_pos: torch.Tensor, num_queries: int | None = None
    ):
        """Attention of the block's queries over the row plus the block (causal).

        Args:
            row_pos: ``[n]`` positions already in the row.
            new_pos: ``[q]`` positions appended by this block (ascending, after row_pos).
            num_queries: only the last this-many queries of the block (a prefill observation
                window); default all.
        Returns:
            probs ``[q', n + q, L, H]`` and lengths ``[q']`` (keys each query sees).
        """
        q = new_pos.numel()
        take = q if num_queries is None else min(q, num_queries)
        qpos = new_pos[q - take :]  # [q']
        kpos = torch.cat([row_pos, new_pos])  # [n + q]
        dist = (qpos.view(-1, 1) - kpos.view(1, -1)).float()  # [q', n + q]
        logits = self.a[kpos].unsqueeze(0) - self.params.gamma * torch.log1p(
            dist.clamp(min=0)
        ).unsqueeze(-1).unsqueeze(-1)
        logits = logits + self.params.sigma_q * self.u[qpos].unsqueeze(1) * self.c[kpos].unsqueeze(
            0
        )
        logits = logits.masked_fill((dist < 0).unsqueeze(-1).unsqueeze(-1), float("-inf"))
        lengths = row_pos.numel() + torch.arange(q - take, q) + 1
        return logits.softmax(dim=1), lengths
