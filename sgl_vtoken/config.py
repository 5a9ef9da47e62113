"""Eviction settings: one frozen dataclass, validated once, carried to every process as JSON.

The server builds it from its flags (``--kv-evict POLICY --kv-budget N --kv-sink --kv-window
--kv-evict-interval --kv-reclaim --kv-evict-config JSON``) and hands it to the scheduler processes
through the environment (:data:`ENV_VAR`), so field names follow the flags and ``to_dict`` /
``from_dict`` round-trip through JSON exactly.

Row arithmetic the fields describe (one request, row coordinates, `budget` live tokens kept)::

    row before eviction                          row after eviction (budget tokens)
    |sink|.......... evictable ..........|window|   ->   |sink|... kept ...|window|
    0    sink                  len-window     len       0                     budget
    eviction runs when len >= budget + interval and keeps exactly `budget` tokens.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from sgl_vtoken.planner import RECLAIM_MODES
from sgl_vtoken.policies import POLICIES, make_policy
from sgl_vtoken.policies.base import AGGREGATIONS

ENV_VAR = "VTOKEN_CONFIG"
DISABLED = "none"


@dataclass(frozen=True)
class EvictConfig:
    """Token eviction and reclamation settings for every request of one server.

    Attributes:
        policy: registry name of the eviction policy, or ``"none"`` (eviction disabled).
        budget: live tokens a request keeps after each eviction (row length cap); required
            unless the policy is ``"none"``. Must be at least ``sink_tokens + window + page_size``.
        sink: attention-sink tokens (positions ``< sink``) that are always kept. At page size
            > 1 it is rounded up to whole pages (:attr:`sink_tokens`) so sink pages never hold holes.
        window: the most recent tokens of the row that are always kept.
        interval: hysteresis; evict when the row reaches ``budget + interval`` (1 = every step).
        reclaim: ``"vtoken"`` (compact survivors, free pages) or ``"naive"`` (same victims; a page
            is freed only when all its tokens are dead).
        page_size: KV pool page size in tokens (SGLang ``--page-size``).
        seed: seed of seeded policies (``random``) and of the simulator.
        aggregation: how per-layer, per-head statistics become one score per token: sum or max.
        params: policy hyperparameters (``--kv-evict-config`` JSON), passed to the policy class.
        obs_window: attention policies: prompt queries whose attention seeds the statistics at
            prefill (the last `obs_window`, SnapKV-style).
        score_layers: attention policies: layer ids whose attention is scored (None: all).
        reuse_history: a finished request leaves its compacted history in the radix cache, and a
            next turn that extends it continues from it instead of re-prefilling.
        prefill_chunk: evict during prefill (None: the prompt is prefilled whole first). The
            prompt is prefilled in chunks: whenever the row reaches ``budget + prefill_chunk``
            live tokens and prompt tokens remain, it is evicted down to `budget` (attention
            policies score with that chunk's last `obs_window` queries), so a request never holds
            more than ``budget + prefill_chunk`` tokens of KV. A multiple of `page_size`, above
            `interval`; `budget` must then be a multiple of `page_size` too.
        offload: evicted tokens' K/V (every layer) go to the host store owned by the request's
            stored history instead of being dropped (docs/design.md, "Host tier and recall").
            Needs `host_tokens`; without `prefill_chunk`, and with reclaim ``"vtoken"`` at page
            size > 1.
        host_tokens: capacity of the server's host store in tokens (0: no host store). When
            full, the stores of the least recently used stored histories are released first.
        recall: tokens a new turn may bring back from its history's host store (0: offload
            only). Scored after the new message's prefill by its last `obs_window` queries; the
            recalled tokens are kept for the rest of the turn, within `budget`.
        recall_pool: odd; each candidate's recall score is first averaged with its `recall_pool
            // 2` candidate neighbours on each side (SnapKV's pooling; 1: off).
        recall_gap: candidates are recalled best first, each with the hole of at most
            `recall_gap` candidates between it and a recalled neighbour, within `recall` (a span
            whose ends score comes back whole; 0: off).
    """

    policy: str = DISABLED
    budget: int | None = None
    sink: int = 4
    window: int = 0
    interval: int = 1
    reclaim: str = "vtoken"
    page_size: int = 1
    seed: int = 0
    aggregation: str = "sum"
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    obs_window: int = 16
    score_layers: tuple[int, ...] | None = None
    reuse_history: bool = True
    prefill_chunk: int | None = None
    offload: bool = False
    host_tokens: int = 0
    recall: int = 0
    recall_pool: int = 1
    recall_gap: int = 0

    def __post_init__(self) -> None:
        names = [DISABLED, *sorted(POLICIES)]
        if self.policy not in names:
            raise ValueError(f"EvictConfig.policy must be one of {names} (got {self.policy!r})")
        _check_choice("reclaim", self.reclaim, RECLAIM_MODES)
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        _check_int("page_size", self.page_size, 1)
        _check_int("sink", self.sink, 0)
        _check_int("window", self.window, 0)
        _check_int("interval", self.interval, 1)
        _check_int("seed", self.seed, 0, 2**32 - 1)
        _check_int("obs_window", self.obs_window, 1)
        if self.score_layers is not None:
            if not isinstance(self.score_layers, (list, tuple)) or not self.score_layers or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in self.score_layers):
                raise ValueError(f"EvictConfig.score_layers must be a non-empty list of layer ids >= 0 "
                                 f"or None (got {self.score_layers!r})")
            object.__setattr__(self, "score_layers", tuple(sorted(set(self.score_layers))))
        if not isinstance(self.reuse_history, bool):
            raise ValueError(f"EvictConfig.reuse_history must be true or false (got {self.reuse_history!r})")
        if not isinstance(self.params, Mapping):
            raise ValueError(f"EvictConfig.params must be a JSON object (got {self.params!r})")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        if self.prefill_chunk is not None:
            _check_int("prefill_chunk", self.prefill_chunk, 1)
        _check_int("host_tokens", self.host_tokens, 0)
        _check_int("recall", self.recall, 0)
        _check_int("recall_pool", self.recall_pool, 1)
        _check_int("recall_gap", self.recall_gap, 0)
        if self.recall_pool % 2 == 0:
            raise ValueError(f"EvictConfig.recall_pool must be odd (got {self.recall_pool})")
        if not isinstance(self.offload, bool):
            raise ValueError(f"EvictConfig.offload must be true or false (got {self.offload!r})")
        if not self.enabled:
            return
        floor = self.sink_tokens + self.window + self.page_size
        if self.budget is None:
            raise ValueError(f"EvictConfig.budget is required when policy={self.policy!r}")
        _check_int("budget", self.budget, floor,  # before any arithmetic on it (prefill, host tier)
                   why=f"sink_tokens + window + page_size = {self.sink_tokens} + {self.window} "
                       f"+ {self.page_size}")
        if self.prefill_chunk is not None:
            self._check_prefill_chunk()
        self._check_offload()
        try:
            make_policy(self.policy, **self.policy_kwargs())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"EvictConfig.params {dict(self.params)} do not fit policy "
                             f"{self.policy!r}: {exc}") from None

    def _check_offload(self) -> None:
        if self.recall and not self.offload:
            raise ValueError(f"EvictConfig.recall {self.recall} needs offload: true (recalled tokens come "
                             "from the host store)")
        if not self.offload:
            return
        if self.host_tokens < 1:
            raise ValueError("EvictConfig.offload needs host_tokens >= 1: the server's host store "
                             "capacity (--kv-evict-config '{\"host_tokens\": N}')")
        if self.page_size > 1 and self.reclaim != "vtoken":
            raise ValueError(f"EvictConfig.offload needs reclaim 'vtoken' at page_size {self.page_size} "
                             f"(got {self.reclaim!r})")
        if self.prefill_chunk is not None:
            raise ValueError("EvictConfig.offload cannot run with prefill_chunk (the prompt's evicted "
                             "tokens would not reach the host store)")
        if self.budget is not None and self.sink_tokens + self.window + self.recall + 1 > self.budget:
            raise ValueError(f"EvictConfig.recall must leave room in the budget: sink_tokens + window + "
                             f"recall + 1 = {self.sink_tokens} + {self.window} + {self.recall} + 1 > "
                             f"budget {self.budget}")

    def _check_prefill_chunk(self) -> None:
        c, ps = self.prefill_chunk, self.page_size
        if c % ps or c <= self.interval:
            raise ValueError(f"EvictConfig.prefill_chunk must be a multiple of page_size {ps} and "
                             f"> interval {self.interval} (got {c})")
        if self.budget is not None and self.budget % ps:
            raise ValueError(f"EvictConfig.budget must be a multiple of page_size {ps} with "
                             f"prefill_chunk (got {self.budget}): chunks end at row budget + prefill_chunk, "
                             "which must be page-aligned")

    @property
    def prefill_peak(self) -> int | None:
        """Row length at which a prefill is evicted when prompt tokens remain, or None."""
        return None if self.prefill_chunk is None else self.budget + self.prefill_chunk

    @property
    def decode_peak(self) -> int:
        """KV tokens an evicting request holds at most while it decodes: the row reaches
        ``budget + interval`` before each eviction, plus the partly filled page of the next."""
        return self.budget + self.interval + self.page_size

    @property
    def enabled(self) -> bool:
        return self.policy != DISABLED

    @property
    def sink_tokens(self) -> int:
        """Sinks rounded up to whole pages: a partially evicted sink page could never be freed."""
        return math.ceil(self.sink / self.page_size) * self.page_size

    def should_evict(self, row_len: int) -> bool:
        """True when a row of `row_len` live tokens must be evicted down to `budget`."""
        return self.enabled and row_len >= self.budget + self.interval

    def policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``make_policy(self.policy, **kwargs)``."""
        kwargs = {"sink": self.sink_tokens, "window": self.window,
                  "aggregation": self.aggregation, **self.params}
        if "seed" in {f.name for f in fields(POLICIES[self.policy])}:
            kwargs.setdefault("seed", self.seed)
        return kwargs

    def history_namespace(self) -> str:
        """Radix-cache namespace of compacted histories: every setting that changes their KV."""
        params = json.dumps(dict(self.params), sort_keys=True)
        return (f"vtoken:{self.policy}:b{self.budget}:s{self.sink_tokens}:w{self.window}"
                f":i{self.interval}:p{self.page_size}:seed{self.seed}:{self.aggregation}"
                f":o{self.obs_window}:l{self.score_layers}:c{self.prefill_chunk}"
                f":off{int(self.offload)}:r{self.recall}:rp{self.recall_pool}:rg{self.recall_gap}:{params}")

    # --- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["params"] = dict(self.params)
        if self.score_layers is not None:
            out["score_layers"] = list(self.score_layers)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EvictConfig":
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(f"EvictConfig has no field(s) {unknown}; allowed: {allowed}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EvictConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"EvictConfig JSON is malformed: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"EvictConfig JSON must be an object (got {type(data).__name__})")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, var: str = ENV_VAR) -> "EvictConfig":
        """The config exported by the launcher, or the disabled default when `var` is unset."""
        text = os.environ.get(var)
        return cls() if text is None else cls.from_json(text)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"EvictConfig.{name} must be one of {list(allowed)} (got {value!r})")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"EvictConfig.{name} must be an integer (got {value!r})")
    bound = f">= {lo}" + (f" ({why})" if why else "") if hi is None else f"in [{lo}, {hi}]"
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"EvictConfig.{name} must be {bound} (got {value})")
