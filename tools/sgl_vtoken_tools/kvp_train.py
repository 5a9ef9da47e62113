"""Training KVP scorers: K/V traces on disk and the ranking objective of arXiv:2602.10238.

Trace file (``torch.save`` of a dict, collected by :mod:`sgl_vtoken_tools.kvp_traces`)::

    identity   dict     ModelIdentity of the traced model
    keys       [S, T, L, H, D] float16   post-RoPE keys of S sequences of T tokens
    values     [S, T, L, H, D] float16
    positions  [T] int64                 0 .. T-1
    cuts       [C] int64                 cut points t: the row is tokens [0, t)
    targets    [S, C, T, L, H] float32   future attention mass of token j < t at cut t: the sum
                                         over queries i in [t, t + horizon) of the attention
                                         probability on j, summed over the query heads of KV
                                         head h (full attention); 0 for j >= t
    horizon    int, meta dict            text source, seed, model path

Objective (per layer and KV head, one problem = one sequence cut at t, sink tokens excluded):
sample K keep-rankings ``pi`` from the Plackett-Luce distribution of the scores (Gumbel-sort);
keeping the top ``b`` of ``pi`` evicts ``pi[b:]``, so summed over every budget b = 1 .. n-1 the
evicted mass is ``A(pi) = sum_i i * m[pi_i]``. The reward is the regret normalized between the
oracle ranking (by true mass) and the reverse one, ``R = -(A - A_oracle) / (A_worst - A_oracle)``
in [-1, 0]; REINFORCE with the leave-one-out baseline of the K samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_vtoken.kvp import KVPScorer, ModelIdentity


@dataclass
class Traces:
    """In-memory trace file (see the module docstring for shapes)."""

    identity: ModelIdentity
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    cuts: torch.Tensor
    targets: torch.Tensor
    horizon: int
    meta: dict

    def save(self, path) -> None:
        d = {
            k: getattr(self, k)
            for k in ("keys", "values", "positions", "cuts", "targets", "horizon", "meta")
        }
        torch.save({**d, "identity": vars(self.identity)}, path)

    @classmethod
    def load(cls, path) -> Traces:
        d = torch.load(path, weights_only=True)
        return cls(identity=ModelIdentity(**d.pop("identity")), **d)


def ranking_loss(
    scores: torch.Tensor, mass: torch.Tensor, num_samples: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE loss and mean reward for scores and target masses ``[..., n]``.

    Returns ``(loss, reward)``: a scalar to minimize, and the mean reward of the sampled
    rankings (in [-1, 0]; 0 = oracle).
    """
    noise = -torch.log(
        -torch.log(torch.rand((num_samples, *scores.shape), generator=gen).clamp_min(1e-20))
    )
    pi = torch.argsort(scores.detach() + noise, dim=-1, descending=True)  # [K, ..., n] keep order
    s_pi = torch.gather(scores.expand_as(pi), -1, pi)
    logp = (s_pi - torch.logcumsumexp(s_pi.flip(-1), dim=-1).flip(-1)).sum(-1)
    reward = normalized_reward(torch.gather(mass.expand_as(pi), -1, pi), mass)
    baseline = (reward.sum(0, keepdim=True) - reward) / max(num_samples - 1, 1)
    return -((reward - baseline).detach() * logp).mean(), reward.mean()


def normalized_reward(mass_in_order: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``-(A - A_oracle) / (A_worst - A_oracle)`` of masses listed in keep order ``[..., n]``."""
    rank = torch.arange(mass.shape[-1], dtype=mass.dtype)
    best = (mass.sort(-1, descending=True).values * rank).sum(-1)
    worst = (mass.sort(-1).values * rank).sum(-1)
    return -((mass_in_order * rank).sum(-1) - best) / (worst - best).clamp_min(1e-12)


def _problem(scorer: KVPScorer, tr: Traces, seqs: torch.Tensor, c: int, sink: int):
    t = int(tr.cuts[c])
    x = scorer.features(tr.keys[seqs, sink:t], tr.values[seqs, sink:t], tr.positions[sink:t])
    m = tr.targets[seqs, c, sink:t].flatten(-2)  # [B, n, G]
    return x, m.transpose(-1, -2).to(torch.float32)  # [B, G, n]


@torch.no_grad()
def fit_feature_stats(scorer: KVPScorer, tr: Traces, sink: int) -> None:
    """Set the scorer's feature standardization from every problem of `tr`."""
    xs = [
        _problem(scorer, tr, torch.arange(tr.keys.shape[0]), c, sink)[0].flatten(0, 1)
        for c in range(len(tr.cuts))
    ]
    x = torch.cat(xs)  # [N, G, F]
    scorer.feat_mean.copy_(x.mean(0))
    scorer.feat_std.copy_(x.std(0).clamp_min(1e-6))


@torch.no_grad()
def evaluate(scorer: KVPScorer, tr: Traces, sink: int, rank_by: str = "scorer") -> float:
    """Mean normalized reward of a noise-free ranking over every problem of `tr`: the scorer's,
    or a heuristic's per head (``"recency"``: newest first; ``"knorm"``: smallest key norm first)."""
    rewards = []
    for c in range(len(tr.cuts)):
        x, m = _problem(scorer, tr, torch.arange(tr.keys.shape[0]), c, sink)
        if rank_by == "scorer":
            s = scorer.forward_features(x).transpose(-1, -2)
        elif rank_by == "recency":
            s = torch.arange(m.shape[-1], dtype=torch.float32).expand_as(m)
        elif rank_by == "knorm":
            s = -x[..., : scorer.identity.head_dim].norm(dim=-1).transpose(-1, -2)
        else:
            raise ValueError(f"rank_by must be 'scorer', 'recency' or 'knorm' (got {rank_by!r})")
        rewards.append(normalized_reward(torch.gather(m, -1, s.argsort(-1, descending=True)), m))
    return float(torch.cat([r.flatten() for r in rewards]).mean())


def train(
    scorer: KVPScorer,
    tr: Traces,
    steps: int,
    seed: int = 0,
    batch: int = 8,
    num_samples: int = 8,
    lr: float = 3e-3,
    sink: int = 4,
    progress=None,
) -> list[dict]:
    """Train `scorer` in place on `tr`; returns one dict per step (loss, sampled reward).

    Deterministic for a given seed on CPU. `progress`, if given, is called as
    ``progress(step, record)`` (e.g. a tqdm update).
    """
    tr.identity.check(scorer.identity, what="traces")
    fit_feature_stats(scorer, tr, sink)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(scorer.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    num_seqs, history = tr.keys.shape[0], []
    for step in range(steps):
        c = int(torch.randint(len(tr.cuts), (1,), generator=gen))
        seqs = torch.randperm(num_seqs, generator=gen)[:batch]
        x, m = _problem(scorer, tr, seqs, c, sink)
        loss, reward = ranking_loss(
            scorer.forward_features(x).transpose(-1, -2), m, num_samples, gen
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        history.append({"step": step, "loss": loss.item(), "reward": reward.item()})
        if progress is not None:
            progress(step, history[-1])
    return history
