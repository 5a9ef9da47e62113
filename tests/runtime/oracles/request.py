"""One request's victim chooser, as `sgl_vtoken_tools.hf_reference` asks for it.

The settings are read from an `EvictConfig` by attribute (policy, sink, window, page_size,
seed, params, scoring); the defaults below are the project's, restated: sinks rounded up to
whole pages, attention policies pooled over 5 neighbours and scored on the upper half of the
layers, H2O aggregated by the largest value over layers and heads and the others by the sum,
Scissorhands over the last 32 queries with threshold 1, span-aware keeping of up to 8 tokens for
the attention policies and none for the others.
"""

from __future__ import annotations

import math

import torch

from .keep import keep_best, protected_entries
from .scores import aggregate, key_norm, pooled, random_scores, request_id, streaming_llm
from .statistics import AccumulatedAttention, LastQueryAttention, PersistentImportance
from .units import keep_whole_units, unit_starts

ATTENTION = {"h2o", "tova", "scissorhands"}


def scored_layers(rule, num_layers: int) -> list[int]:
    """Layers whose attention feeds the statistic: ``"upper"`` the upper half
    (``num_layers // 2`` and up), None or ``"all"`` every layer, or the listed ids."""
    if rule == "upper":
        return list(range(num_layers // 2, num_layers))
    if rule is None or rule == "all":
        return list(range(num_layers))
    return [i for i in rule if i < num_layers]


class OracleRequest:
    """Chooses one request's victims under `cfg`'s policy; `rid` seeds the random policy.

    Interface (`hf_rules.RequestPolicy`): `needs` (statistics `keep` reads: "attn",
    "keys"), `observe(row, probs [q, n, L, H], lengths [q])` with every layer's
    probabilities over the row, and `keep(row, shared, keys, budget)` -> ascending row
    indices kept (one eviction; the next one is the next step of the seeded policy). A layer
    left out of `score_layers` feeds no statistic. With a span, `keep` reads the
    texts of the sequence's tokens and keeps words and digit runs whole (`units.py`)."""

    def __init__(self, cfg, rid: str = "") -> None:
        params = dict(cfg.params)
        self.name, self.rid, self.step = cfg.policy, request_id(rid), 0
        span = cfg.scoring.span
        self.span = span if span is not None else 8 if self.name in ATTENTION else 0
        page = cfg.page_size
        self.sink = params.get("sink", math.ceil(cfg.sink / page) * page)
        self.window = params.get("window", cfg.window)
        self.how = (
            cfg.scoring.aggregation
            or params.get("aggregation")
            or ("max" if self.name == "h2o" else "sum")
        )
        self.pool = params.get("pool", 5)
        self.layers = cfg.scoring.score_layers
        self.seed = params.get("seed", cfg.seed)
        self.stats = {
            "h2o": AccumulatedAttention,
            "tova": LastQueryAttention,
            "scissorhands": lambda: PersistentImportance(
                params.get("history", 32), params.get("threshold", 1.0)
            ),
        }.get(self.name, lambda: None)()
        self.needs = frozenset(
            {"attn"} if self.name in ATTENTION else {"keys"} if self.name == "knorm" else set()
        )
        if self.name not in ATTENTION | {"streamingllm", "random", "knorm"}:
            raise ValueError(f"no oracle for policy {self.name!r}")

    def observe(self, row: list[int], probs: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.stats is not None:
            layers = scored_layers(self.layers, probs.shape[2])
            self.stats.observe(row, probs[:, :, layers], lengths)

    def scores(self, row: list[int], keys) -> list[float]:
        if self.name == "streamingllm":
            return streaming_llm(row)
        if self.name == "random":
            return random_scores(row, self.seed, self.rid, self.step)
        if self.name == "knorm":
            return key_norm(keys, self.how)
        return pooled(aggregate(self.stats.stat(row), self.how), self.pool)

    def keep(self, row: list[int], shared: list[bool], keys, budget: int, texts=()) -> list[int]:
        scores = self.scores(row, keys)
        protected = protected_entries(row, self.sink, self.window, shared)
        if self.span and len(row) > budget:
            starts = unit_starts(list(texts)[: row[-1] + 1], self.span)
            kept = keep_whole_units(scores, protected, budget, [starts[p] for p in row])
        else:
            kept = keep_best(scores, protected, budget)
        self.step += 1
        if self.stats is not None:
            self.stats.forget(set(row) - {row[i] for i in kept})
        return kept


def oracle_policy(cfg, rid: str = "") -> OracleRequest:
    """The oracle chooser of one request, by the papers' definitions (`hf_reference`'s
    `policy=` argument)."""
    return OracleRequest(cfg, rid)
