"""The runtime's victim choice behind `hf_reference`'s interfaces: the one place the reference
reaches `sgl_vtoken`'s policies, statistics and recall rule.

Scripts and the quality harness pass these (`policy=runtime_policy`, `recall=RUNTIME_RECALL`)
to replay what the server's own code would choose; the exactness tests pass the independent
oracles of `tests/runtime/oracles` instead, so that they check the policies, not only the plumbing.
"""

from __future__ import annotations

import torch

from sgl_vtoken.config import EvictConfig, policy_from_config
from sgl_vtoken.recall import GAP, POOL, candidate_mass, pick, round_quota, split, turn_rounds
from sgl_vtoken.rng import stable_id
from sgl_vtoken.types import TokenView
from sgl_vtoken.units import Words


class RuntimeRequest:
    """`hf_rules.RequestPolicy` of `policy_from_config(cfg)` with its accumulator: the
    layers outside `score_layers` stage zeros, as the server stages them. With a `span`, the
    units come from the texts of the sequence's tokens (`Words` of those texts)."""

    def __init__(self, cfg: EvictConfig, rid: str = "") -> None:
        self.cfg, self.rid, self.step = cfg, stable_id(rid), 0
        self.policy = policy_from_config(cfg)
        self.acc = self.policy.new_accumulator()
        self.needs = frozenset(self.policy.needs)

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.acc is None:
            return
        scored = self.cfg.scoring.layer_ids(probs.shape[2])
        if scored is not None:
            probs = probs.clone()
            probs[:, :, [i for i in range(probs.shape[2]) if i not in scored]] = 0
        self.acc.update(probs, lengths)

    def keep(self, row: list[int], shared: list[bool], keys, budget: int, texts=()) -> list[int]:
        positions = torch.tensor(row, dtype=torch.int64)
        span, units = self.policy.span, None
        if span:
            seq = list(texts)[: row[-1] + 1]
            units = Words(seq).unit_starts(range(len(seq)), span)[positions]
        view = TokenView(
            positions=positions,
            keys=keys,
            attn=self.acc.stats if self.acc is not None else None,
            shared=torch.tensor(shared, dtype=torch.bool),
            rid=self.rid,
            step=self.step,
            units=units,
        )
        keep = self.policy.keep(view, budget)
        if self.acc is not None:
            self.acc.select(keep)
        self.step += 1
        return keep.tolist()


def runtime_policy(cfg: EvictConfig, rid: str = "") -> RuntimeRequest:
    """The runtime's chooser of one request (`hf_reference`'s `policy=` argument)."""
    return RuntimeRequest(cfg, rid)


class RuntimeRecall:
    """`hf_rules.RecallRule` of `sgl_vtoken.recall`."""

    def split(self, cfg: EvictConfig, prefix: int, total: int) -> tuple[int, int] | None:
        return split(prefix, total, cfg.scoring.obs_window, cfg.page_size)

    def rounds(self, cfg: EvictConfig) -> int:
        return turn_rounds(cfg.host.recall, cfg.host.rounds)

    def quota(self, cfg: EvictConfig, done: int, last: bool) -> int:
        return round_quota(cfg.host.recall, cfg.host.rounds, done, last)

    def choose(
        self, cfg: EvictConfig, layers, lengths, k: int, positions=(), recalled=()
    ) -> list[int]:
        scores = torch.zeros(layers[0][3].shape[0])
        scored = cfg.scoring.layer_ids(len(layers))
        for i, (q, scale, row_keys, cand_keys) in enumerate(layers):
            if scored is None or i in scored:
                scores += candidate_mass(q, row_keys, lengths, cand_keys, scale)
        return pick(
            scores,
            k,
            POOL,
            GAP,
            torch.tensor(list(positions), dtype=torch.int64),
            torch.tensor(list(recalled), dtype=torch.int64),
        ).tolist()


RUNTIME_RECALL = RuntimeRecall()
